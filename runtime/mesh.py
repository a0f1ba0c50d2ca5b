"""The device mesh ("pp", "dp", "tp") of a layout, and this rank's coordinates in it.

tp is the fastest-varying axis (tensor-parallel groups are neighbouring ranks, inside a node) and pp the slowest,
as in Megatron-LM. Context parallelism (cp > 1) is not implemented by this runtime yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mlm.planner.errors import Infeasible
from mlm.planner.layout import Layout

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshInfo:
    mesh: DeviceMesh
    pp_rank: int
    dp_rank: int
    tp_rank: int

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    def global_rank(self, pp: int, dp: int, tp: int) -> int:
        shape = self.mesh.mesh.shape  # arithmetic, not a tensor lookup: also valid under a FakeTensorMode
        return (pp * shape[1] + dp) * shape[2] + tp


def check_supported(layout: Layout) -> None:
    """mlm-run executes tp, pp, dp and ZeRO; context and expert parallelism are planned but not run yet."""
    for name, size, what in (("cp", layout.cp, "context"), ("ep", getattr(layout, "ep", 1), "expert")):
        if size != 1:
            raise Infeasible(
                f"layout.{name} = {size}: {what} parallelism is planned by mlm-plan but not run by mlm-run yet; "
                f"plan with --{name} 1"
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
    return MeshInfo(mesh, coords[0], coords[1], coords[2])
