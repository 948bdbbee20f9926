"""The backend registry: registration, the live BackendType, entry-point plugins."""

from __future__ import annotations

import pickle
import sys
import textwrap
import threading
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
from rpcreg_socket_agent import SocketAgent, SocketOptions, construct_options, init_agent

import rpc_registry
from rpc_registry import (
    BackendRegistry,
    BackendType,
    BackendValue,
    backend_registered,
    construct_rpc_backend_options,
    init_backend,
    register_backend,
)

GROUP = "rpc_registry.backends"


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8].upper()}"


class RecordingOptions:
    def __init__(self, rpc_timeout: float, init_method: str, **extra: Any) -> None:
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method
        self.extra = extra


def record_options(rpc_timeout: float, init_method: str, **kwargs: Any) -> RecordingOptions:
    return RecordingOptions(rpc_timeout, init_method, **kwargs)


def test_registered_backend_is_reachable_by_attribute_item_and_iteration() -> None:
    name = _unique("ATTR")
    member = register_backend(name, construct_options, init_agent)
    assert getattr(BackendType, name) is member
    assert BackendType[name] is member
    assert member in list(BackendType)
    assert member in BackendType
    assert backend_registered(name)


def test_member_has_repr_name_and_backend_value() -> None:
    name = _unique("REPR")
    member = register_backend(name, construct_options, init_agent)
    assert repr(member) == f"BackendType.{name}"
    assert member.name == name
    assert member.value == BackendValue(construct_options, init_agent)


def test_member_survives_pickling_as_the_same_member() -> None:
    member = register_backend(_unique("PICKLE"), construct_options, init_agent)
    assert pickle.loads(pickle.dumps(member)) is member


def test_registering_a_name_twice_raises() -> None:
    name = _unique("TWICE")
    register_backend(name, construct_options, init_agent)
    with pytest.raises(RuntimeError, match=f"^RPC backend {name}: already registered$"):
        register_backend(name, construct_options, init_agent)


def test_backend_name_must_be_an_identifier() -> None:
    with pytest.raises(ValueError, match=r"backend_name='not a name'"):
        register_backend("not a name", construct_options, init_agent)


def test_concurrent_registration_from_threads_keeps_every_backend_once() -> None:
    shared = _unique("SHARED")
    names = [_unique("THREAD") for _ in range(16)]
    barrier = threading.Barrier(len(names))
    outcomes: list[str] = []
    lock = threading.Lock()

    def register(own: str) -> None:
        barrier.wait(timeout=10)
        register_backend(own, construct_options, init_agent)
        try:
            register_backend(shared, construct_options, init_agent)
            result = "won"
        except RuntimeError:
            result = "lost"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=register, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(outcomes) == ["lost"] * (len(names) - 1) + ["won"]
    registered = [member.name for member in BackendType]
    assert all(registered.count(n) == 1 for n in [*names, shared])


def test_backend_type_imported_earlier_sees_later_registrations() -> None:
    earlier = BackendType  # bound at this module's import, before the registration
    name = _unique("LATER")
    member = register_backend(name, construct_options, init_agent)
    assert earlier[name] is member
    assert rpc_registry.BackendType is earlier


def test_unknown_member_lookup_says_what_to_do() -> None:
    with pytest.raises(AttributeError, match=r"'NO_SUCH_BACKEND' is not registered.*register_backend"):
        _ = BackendType.NO_SUCH_BACKEND
    with pytest.raises(KeyError, match="NO_SUCH_BACKEND"):
        BackendType["NO_SUCH_BACKEND"]
    assert not backend_registered("NO_SUCH_BACKEND")


def test_construct_rpc_backend_options_passes_every_keyword_to_handler() -> None:
    member = register_backend(_unique("OPTS"), record_options, init_agent)
    options = construct_rpc_backend_options(
        member, rpc_timeout=5.0, device_maps={"w1": {0: 1}}, devices=["cpu"]
    )
    assert isinstance(options, RecordingOptions)
    assert (options.rpc_timeout, options.init_method) == (5.0, "env://")
    assert options.extra == {"device_maps": {"w1": {0: 1}}, "devices": ["cpu"]}


def test_construct_rpc_backend_options_rejects_a_non_member() -> None:
    with pytest.raises(TypeError, match=r"backend='SOCKET'.*member of BackendType"):
        construct_rpc_backend_options("SOCKET")  # type: ignore[arg-type]


def test_init_backend_returns_the_agent_of_the_handler() -> None:
    from torch.distributed import HashStore  # type: ignore[attr-defined]

    member = register_backend(_unique("INIT"), construct_options, init_agent)
    agent = init_backend(
        member,
        store=HashStore(),
        name="solo",
        rank=0,
        world_size=1,
        rpc_backend_options=SocketOptions(rpc_timeout=5.0),
    )
    try:
        assert isinstance(agent, SocketAgent)
        assert agent.get_worker_infos() == [agent.get_worker_info()]
    finally:
        agent.shutdown()


# Plugins: real distributions written into a temporary site directory.

_PLUGIN_SOURCE = """
def construct(rpc_timeout, init_method, **kwargs):
    return ("options", rpc_timeout, init_method, kwargs)

def init(*args, **kwargs):
    return ("agent", args, kwargs)

class Plugin:
    def __init__(self, name):
        self.name = name
        self.construct_rpc_backend_options_handler = construct
        self.init_backend_handler = init

plugin = Plugin({name!r})

def make_plugin():
    return Plugin({factory_name!r})
"""


def _install(site: Path, dist: str, module: str, source: str, entry_points: dict[str, str]) -> None:
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_backend_is_found_and_imported_only_when_used(site: Path) -> None:
    module, name, factory_name = _unique("plugmod").lower(), _unique("PLUGGED"), _unique("MADE")
    source = _PLUGIN_SOURCE.format(name=name, factory_name=factory_name)
    entry_points = {name: f"{module}:plugin", factory_name: f"{module}:make_plugin"}
    _install(site, "plugged-backend", module, source, entry_points)
    registry = BackendRegistry()

    assert registry.get("NOT_THERE") is None  # reads the group
    assert module not in sys.modules
    member = registry.get(name)
    assert member is not None and module in sys.modules
    options: object = member.value.construct_rpc_backend_options_handler(1.0, "env://", devices=[0])
    assert options == (
        "options",
        1.0,
        "env://",
        {"devices": [0]},
    )
    made = registry.get(factory_name)
    assert made is not None and made.name == factory_name
    with pytest.raises(RuntimeError, match="already registered"):
        registry.register(name, construct_options, init_agent)


def test_entry_point_group_is_read_once_and_cached(site: Path) -> None:
    registry = BackendRegistry()
    installed_before = {member.name for member in registry.members()}  # e.g. an installed TENSORPIPE
    name, module = _unique("LATE"), _unique("latemod").lower()
    _install(
        site,
        "late-backend",
        module,
        _PLUGIN_SOURCE.format(name=name, factory_name="X"),
        {name: f"{module}:plugin"},
    )
    assert registry.get(name) is None
    assert {member.name for member in registry.members()} == installed_before
    fresh = BackendRegistry()
    assert fresh.get(name) is not None


def test_broken_plugin_warns_once_naming_its_distribution_and_others_load(site: Path) -> None:
    good, good_module = _unique("GOOD"), _unique("goodmod").lower()
    broken, broken_module = _unique("BROKEN"), _unique("brokenmod").lower()
    _install(
        site,
        "good-backend",
        good_module,
        _PLUGIN_SOURCE.format(name=good, factory_name="X"),
        {good: f"{good_module}:plugin"},
    )
    _install(
        site,
        "broken-backend",
        broken_module,
        "raise ImportError('needs libfoo')\n",
        {broken: f"{broken_module}:plugin"},
    )
    registry = BackendRegistry()
    with pytest.warns(RuntimeWarning, match=r"'broken-backend'|broken-backend") as caught:
        names = [member.name for member in registry.members()]
    ours = {good, broken}
    assert [n for n in names if n in ours or n.startswith(("GOOD", "BROKEN"))] == [good]
    assert len(caught) == 1 and "needs libfoo" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.get(broken) is None
        assert [member.name for member in registry.members()] == names


def test_a_broken_plugin_asked_for_by_name_says_why_and_loads_once_its_environment_is_fixed(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, module = _unique("FIXED"), _unique("fixedmod").lower()
    _install(site, "fixed-backend", module, "raise ImportError('needs libfoo')\n", {name: f"{module}:plugin"})
    registry = BackendRegistry()
    monkeypatch.setattr(rpc_registry.registry, "_REGISTRY", registry)
    with pytest.warns(RuntimeWarning, match="needs libfoo"):
        assert registry.get(name) is None
    # The lookup names the failure, not "install the distribution that provides it".
    with pytest.raises(
        AttributeError, match=r"fixed-backend could not be loaded \(ImportError: needs libfoo\)"
    ):
        getattr(BackendType, name)
    (site / f"{module}.py").write_text(textwrap.dedent(_PLUGIN_SOURCE.format(name=name, factory_name="X")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        member = getattr(BackendType, name)
    assert member.name == name and registry.load_failure(name) is None
    assert name in [m.name for m in registry.members()]


def test_plugin_whose_name_differs_from_its_entry_point_is_rejected(site: Path) -> None:
    entry, module = _unique("ENTRY"), _unique("mismatch").lower()
    _install(
        site,
        "mismatch-backend",
        module,
        _PLUGIN_SOURCE.format(name="OTHER", factory_name="X"),
        {entry: f"{module}:plugin"},
    )
    with pytest.warns(RuntimeWarning, match=r"mismatch-backend.*differs from its entry point"):
        assert BackendRegistry().get(entry) is None
