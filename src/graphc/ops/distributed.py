"""Process groups by semantic name, for the kernels of graphc's collective ops.

Graphs name groups semantically ("world", "cp", "ep"); each rank registers its own groups under
fixed names in c10d's registry (`graphc.cp`, ...), so a graph resolves them whatever order they
were created in, and without graphc keeping distributed state of its own. Without an initialised
default group every collective is the single-device identity.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _resolve_process_group

from graphc.topology import GROUPS, Topology

PREFIX = "graphc."


def process_group(name: str):
    """This rank's group called `name`, or None on a single device."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return _resolve_process_group(PREFIX + name)


def register_groups(topology: Topology, rank: int) -> None:
    """Create and name this rank's groups. Every rank must call it (new_group is collective)."""
    if dist.get_world_size() != topology.world:
        raise RuntimeError(f"the process group has {dist.get_world_size()} ranks; the topology needs {topology.world}")
    world = dist.group.WORLD
    for name in GROUPS:
        mine = world
        if topology.group_size(name) < topology.world:
            for ranks in topology.groups(name):  # every rank creates every group, in the same order
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine = group
        _register_process_group(PREFIX + name, mine)
