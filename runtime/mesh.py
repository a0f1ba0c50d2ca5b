"""The device mesh ("pp", "dp", "tp") of a layout, and this rank's coordinates in it.

tp is the fastest-varying axis (tensor-parallel groups are neighbouring ranks, inside a node), then cp, dp and pp,
as in Megatron-Core. The mesh's "dp" axis is the dp·cp ranks that reduce gradients together (Megatron-Core's dp_cp
group: context-parallel ranks hold the same weights and different tokens), so DDP / FSDP2 work over it unchanged;
with cp > 1 a second mesh ("pp", "dp", "cp", "tp") gives the cp groups, and `data_rank` the dp index that chooses
the rows (every cp rank of one data-parallel replica reads the same sequences and keeps its part, see
context_parallel.py). Expert parallelism (ep > 1, carved out of dp·cp as in Megatron-Core) adds a mesh over the
same ranks, ("pp", "edp", "ep", "tp") with dp·cp = edp · ep and ep the faster part: an ep group is ep neighbouring
dp·cp ranks, and the edp ranks that hold the same experts are ep apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mlm.planner.errors import Infeasible
from mlm.planner.layout import Layout

AXES = ("pp", "dp", "tp")
EXPERT_AXES = ("pp", "edp", "ep", "tp")
CONTEXT_AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class MeshInfo:
    mesh: DeviceMesh
    pp_rank: int
    dp_rank: int
    tp_rank: int
    expert_mesh: DeviceMesh | None = None  # ("pp", "edp", "ep", "tp") when ep > 1
    cp_mesh: DeviceMesh | None = None  # ("pp", "dp", "cp", "tp") when cp > 1

    @property
    def cp_size(self) -> int:
        return self.cp_mesh["cp"].size() if self.cp_mesh is not None else 1

    @property
    def cp_rank(self) -> int:
        return self.dp_rank % self.cp_size  # cp is the faster part of the dp·cp axis

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.cp_mesh["cp"].get_group() if self.cp_mesh is not None else None

    @property
    def data_rank(self) -> int:
        """The data-parallel replica this rank belongs to (which rows of the global batch it reads)."""
        return self.dp_rank // self.cp_size

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def ep_size(self) -> int:
        return self.expert_mesh["ep"].size() if self.expert_mesh is not None else 1

    @property
    def ep_rank(self) -> int:
        return self.expert_mesh["ep"].get_local_rank() if self.expert_mesh is not None else 0

    @property
    def ep_group(self) -> dist.ProcessGroup:
        assert self.expert_mesh is not None
        return self.expert_mesh["ep"].get_group()

    @property
    def expert_dp_mesh(self) -> DeviceMesh:
        """The data-parallel mesh of the routed experts: the dp ranks holding the same experts."""
        assert self.expert_mesh is not None
        return self.expert_mesh["edp"]

    def global_rank(self, pp: int, dp: int, tp: int) -> int:
        shape = self.mesh.mesh.shape  # arithmetic, not a tensor lookup: also valid under a FakeTensorMode
        return (pp * shape[1] + dp) * shape[2] + tp


def check_supported(layout: Layout) -> None:
    """mlm-run executes tp, pp, dp, cp, ZeRO and ep; ep is carved out of dp·cp."""
    if layout.cp < 1:
        raise Infeasible(f"layout.cp = {layout.cp} must be >= 1")
    if layout.ep > 1:
        if (layout.dp * layout.cp) % layout.ep:
            raise Infeasible(
                f"layout.ep = {layout.ep} must divide dp·cp = {layout.dp * layout.cp} (ep is carved out of dp·cp)"
            )


def build_mesh(layout: Layout, device_type: str) -> MeshInfo:
    """A 3-D mesh over the already initialized default process group."""
    check_supported(layout)
    world = dist.get_world_size()
    if world != layout.world_size:
        raise Infeasible(
            f"the plan needs {layout.world_size} processes ({layout.describe().split()[0]}) but {world} were launched"
        )
    dp = layout.dp * layout.cp  # the ranks that reduce gradients together (module doc)
    mesh = init_device_mesh(device_type, (layout.pp, dp, layout.tp), mesh_dim_names=AXES)
    coords = mesh.get_coordinate()
    assert coords is not None
    experts = contexts = None
    if layout.ep > 1:
        shape = (layout.pp, dp // layout.ep, layout.ep, layout.tp)
        experts = init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_AXES)
    if layout.cp > 1:
        shape = (layout.pp, layout.dp, layout.cp, layout.tp)
        contexts = init_device_mesh(device_type, shape, mesh_dim_names=CONTEXT_AXES)
    return MeshInfo(mesh, coords[0], coords[1], coords[2], experts, contexts)
