"""Lightning strategies for training and exact evaluation with uneven inputs across ranks.

``Trainer(strategy=JoinDDPStrategy(), use_distributed_sampler=False)`` trains
with a different number of batches per rank: :class:`JoinDDPStrategy` runs
each epoch's batches under :class:`join_core.Join` with
:class:`ddp_join.DistributedDataParallel`, and with ``exact_eval=True``
validates and tests on every sample exactly once.
:class:`JoinFSDPStrategy` does the same for a model sharded with FSDP2's
``fully_shard`` (Lightning's ``ModelParallelStrategy``).
:class:`EvaluationSteps` is the Joinable of a loop without a gradient sync.
"""

from lightning_join.evaluation import EvaluationSteps
from lightning_join.metrics import gather_all_tensors
from lightning_join.model_parallel import JoinFSDPStrategy
from lightning_join.strategy import JoinDDPStrategy

__version__ = "0.1.0"

__all__ = ["EvaluationSteps", "JoinDDPStrategy", "JoinFSDPStrategy", "gather_all_tensors"]
