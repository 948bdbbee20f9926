"""Join: distributed training with uneven inputs across ranks.

Ranks that run out of inputs shadow the collectives of the ranks that have
not, so nobody hangs. See :class:`Join`, :class:`Joinable` and :class:`JoinHook`;
:class:`ShadowCollectives` shadows the collectives no joinable owns
(:class:`OwnedCollectives` marks those a joinable owns).
"""

from join_core.collective_watch import DEFAULT_HANG_TIMEOUT, CollectiveDesyncError
from join_core.exit_grace import install_exit_grace
from join_core.hook import JoinHook
from join_core.join import Join, JoinAbortedError
from join_core.joinable import Joinable
from join_core.liveness import DEFAULT_LIVENESS_TIMEOUT, RankLostError, spare_connections
from join_core.recorder import CollectiveRecord, CollectiveRecorder, record_collectives, recorder
from join_core.regroup import RankRemovedError, Recovery
from join_core.shadow import CollectiveMismatchError, OwnedCollectives, ShadowCollectives
from join_core.watch import CollectiveWatchHandle, watch_collectives

__version__ = "0.2.0"
"""This distribution's version (see CHANGELOG.md)."""

__all__ = [
    "DEFAULT_HANG_TIMEOUT",
    "DEFAULT_LIVENESS_TIMEOUT",
    "CollectiveDesyncError",
    "CollectiveRecord",
    "CollectiveRecorder",
    "CollectiveWatchHandle",
    "CollectiveMismatchError",
    "Join",
    "JoinAbortedError",
    "JoinHook",
    "Joinable",
    "OwnedCollectives",
    "RankLostError",
    "RankRemovedError",
    "Recovery",
    "ShadowCollectives",
    "install_exit_grace",
    "record_collectives",
    "recorder",
    "spare_connections",
    "watch_collectives",
]
