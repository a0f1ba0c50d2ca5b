"""The device mesh ("pp", "dp", "tp") of a layout, and this rank's coordinates in it.

tp is the fastest-varying axis (tensor-parallel groups are neighbouring ranks, inside a node) and pp the slowest,
as in Megatron-LM. Expert parallelism (ep > 1, carved out of dp as in Megatron-Core) adds a second mesh over the
same ranks, ("pp", "edp", "ep", "tp") with dp = edp · ep and ep the faster part: an ep group is ep neighbouring dp
ranks, and the edp ranks that hold the same experts are ep apart. Context parallelism (cp > 1) is not implemented by
this runtime yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mlm.planner.errors import Infeasible
from mlm.planner.layout import Layout

AXES = ("pp", "dp", "tp")
EXPERT_AXES = ("pp", "edp", "ep", "tp")


@dataclass(frozen=True)
class MeshInfo:
    mesh: DeviceMesh
    pp_rank: int
    dp_rank: int
    tp_rank: int
    expert_mesh: DeviceMesh | None = None  # ("pp", "edp", "ep", "tp") when ep > 1

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
    """mlm-run executes tp, pp, dp, ZeRO and ep (with tp 1); context parallelism is planned but not run yet."""
    if layout.cp != 1:
        raise Infeasible(
            f"layout.cp = {layout.cp}: context parallelism is planned by mlm-plan but not run by mlm-run yet; "
            f"plan with --cp 1"
        )
    if layout.ep > 1:
        if layout.dp % layout.ep:
            raise Infeasible(f"layout.ep = {layout.ep} must divide dp = {layout.dp} (ep is carved out of dp)")
        if layout.tp > 1:
            raise Infeasible(
                f"layout.ep = {layout.ep} with tp = {layout.tp}: mlm-run runs expert parallelism with tp 1 only "
                f"(expert-tensor parallelism is not run yet); plan with --tp 1 or --ep 1"
            )


def build_mesh(layout: Layout, device_type: str) -> MeshInfo:
    """A 3-D mesh over the already initialized default process group."""
    check_supported(layout)
    world = dist.get_world_size()
    if world != layout.world_size:
        raise Infeasible(
            f"the plan needs {layout.world_size} processes (pp{layout.pp}·dp{layout.dp}·tp{layout.tp}) "
            f"but {world} were launched"
        )
    mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=AXES)
    coords = mesh.get_coordinate()
    assert coords is not None
    experts = None
    if layout.ep > 1:
        shape = (layout.pp, layout.dp // layout.ep, layout.ep, layout.tp)
        experts = init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_AXES)
    return MeshInfo(mesh, coords[0], coords[1], coords[2], experts)
