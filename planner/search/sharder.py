"""The tensor-parallel sharding ILP per (tp, sequence parallelism), solved once each and shared by the layout
search (which prices every candidate with the styles the ILP chose: cost/inputs.py with_tp_styles) and by
make_plan (which writes those styles into plan.json), so a layout is costed as the program mlm-run executes."""

from __future__ import annotations

from collections.abc import Iterable

from mlm.planner.capture.graph import ModelIR
from mlm.planner.cost.collectives import group_link
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile
from mlm.planner.cost.inputs import ModelCostInputs, summarize, with_tp_styles
from mlm.planner.errors import Infeasible
from mlm.planner.search.tp_sharding import TPCost, TPSharding, plan_tensor_parallel


def tp_cost(gpu: GPUProfile, cluster: ClusterProfile, tp: int) -> TPCost:
    """The sharding ILP's prices on the target hardware: the GPU profile's peak and HBM bandwidth, and the bus
    bandwidth of a tp group as the cost model's collectives see it (planner/cost/collectives.py group_link)."""
    link = group_link(cluster, max(tp, 1), 1)
    return TPCost.from_profiles(gpu, link_gbps=link.bus_bytes_per_s / 1e9)


class Sharder:
    """The sharding ILP per (tp, sequence parallelism), cached; a failure is kept as its reason."""

    def __init__(
        self, ir: ModelIR, gpu: GPUProfile, cluster: ClusterProfile, solver: str = "cbc", time_limit_s: float = 10.0
    ) -> None:
        self.ir, self.gpu, self.cluster = ir, gpu, cluster
        self.solver, self.time_limit_s = solver, time_limit_s
        self.done: dict[tuple[int, bool], TPSharding | str] = {}
        self.inputs: dict[frozenset[tuple[int, bool]], ModelCostInputs] = {}

    def solve(self, tp: int, sequence_parallel: bool) -> TPSharding | str:
        key = (tp, sequence_parallel)
        if key not in self.done:
            try:
                self.done[key] = plan_tensor_parallel(
                    self.ir,
                    tp,
                    sequence_parallel,
                    solver=self.solver,
                    time_limit_s=self.time_limit_s,
                    cost=tp_cost(self.gpu, self.cluster, tp),
                )
            except Infeasible as e:
                self.done[key] = str(e)
        return self.done[key]

    def known_bad(self, tp: int, sequence_parallel: bool) -> bool:
        return isinstance(self.done.get((tp, sequence_parallel)), str)

    def bad_keys(self) -> frozenset[tuple[int, bool]]:
        """The (tp, sequence parallelism) pairs solved so far that have no runnable sharding."""
        return frozenset(k for k, v in self.done.items() if isinstance(v, str))

    def priced_inputs(self, keys: Iterable[tuple[int, bool]]) -> ModelCostInputs:
        """The cost inputs of the model with the blocks split as the ILP splits them at each (tp, sp) of `keys`
        (Megatron's rule where the ILP agrees with it, or where it finds no sharding: such layouts are skipped
        later with the ILP's reason)."""
        wanted = frozenset(k for k in keys if k[0] > 1)
        if wanted not in self.inputs:
            inputs = summarize(self.ir)
            for tp, sp in sorted(wanted):
                got = self.solve(tp, sp)
                if isinstance(got, TPSharding):
                    inputs = with_tp_styles(inputs, self.ir, tp, sp, got.states)
            self.inputs[wanted] = inputs
        return self.inputs[wanted]
