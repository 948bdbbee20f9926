"""Join: distributed training with uneven inputs across ranks.

Ranks that run out of inputs shadow the collectives of the ranks that have
not, so nobody hangs. See :class:`Join`, :class:`Joinable` and :class:`JoinHook`.
"""

from join_core.hook import JoinHook
from join_core.join import Join, JoinAbortedError
from join_core.joinable import Joinable
from join_core.liveness import RankLostError

__all__ = ["Join", "JoinAbortedError", "JoinHook", "Joinable", "RankLostError"]
