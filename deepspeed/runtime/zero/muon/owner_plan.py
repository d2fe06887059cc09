# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which rank orthogonalizes which Muon matrix: the owner plan (pure Python, no torch).

Every rank builds the same plan from the same matrix shapes, so it is never communicated (the binding checks once, at
initialization, that the ranks agree). Terms: *pieces*, ``pieces[r]`` the elements of a matrix's flattened gradient
rank ``r`` holds (ZeRO-3: ``ceil(ds_numel / W)`` on every rank, zero-padded; ZeRO-1/2: the run of the flat buffer each
partition covers, so most matrices have one holder); *owner rank*, the rank that receives every piece of a matrix's
Newton-Schulz (NS) input, runs NS once on the whole matrix and sends each rank its piece of the result; *bucket*,
consecutive matrices exchanged together (buckets bound the exchange buffers).

Owners are balanced by NS cost per bucket, since every rank waits for a bucket's slowest owner: greedy
longest-processing-time-first into W bins (LPT, Graham 1969, "Bounds on multiprocessing timing anomalies"), then the
heaviest bin to the least loaded rank so far, balancing the totals too; a matrix only some ranks hold goes to the least
loaded of them. ``max_step_memory`` sizes the buckets (``plan_partition``): a byte cap on what Muon's step adds on a
rank (``plan_within_cap``), or ``STRICT``, each rank's momentum partition (``plan_for_depth``), which shrinks as 1/W
while a whole matrix and its NS working set do not, so from some W it leaves one owner computing while others wait;
hence a byte cap of its own.
"""

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

NS_STEPS_DEFAULT = 5
"""Newton-Schulz iterations upstream ``muon_update`` runs (its ``ns_steps`` default)."""


@dataclass(frozen=True)
class MatrixSpec:
    """One Muon parameter as the plan sees it.

    Attributes:
        shape, ns_method: the full shape (ZeRO-3: ``ds_shape``; at least 2-D); the group's ``ns_method``.
        is_expert_group, num_heads: the parameter's ``is_expert_group`` and ``muon_num_heads``.
        ns_problem: ``(batch, rows, cols)`` NS runs on (upstream ``original_muon.muon_ns_problem``); may be omitted
            for a 2-D matrix without heads.
        split, parts: a fused parameter's ``(dim, sizes)`` (``newton_schulz.SPLIT_ATTR``) and its parts' ``(batch,
            rows, cols)`` per distinct shape; None and () for one matrix.
        extra_numel: elements the owner allocates around NS besides (a spread matrix's storage and whole copy).
        travels: False where its one holder orthogonalizes it in place (pieces on the NS device): no exchange buffer.

    Raises:
        ValueError: ``ns_problem`` omitted for a tensor that is not 2-D or has ``num_heads``.
    """
    shape: Tuple[int, ...]
    ns_method: str = "gram"
    is_expert_group: bool = False
    num_heads: Optional[int] = None
    ns_problem: Optional[Tuple[int, int, int]] = None
    split: Optional[Tuple[int, Tuple[int, ...]]] = None
    parts: Tuple[Tuple[int, int, int], ...] = ()
    extra_numel: int = 0
    travels: bool = True

    def __post_init__(self):
        if self.ns_problem is None:
            if len(self.shape) != 2 or self.num_heads is not None:
                raise ValueError(f"MatrixSpec of shape {tuple(self.shape)} (num_heads={self.num_heads}) needs its "
                                 "ns_problem (original_muon.muon_ns_problem); only a 2-D matrix without heads is "
                                 "one problem of its own shape.")
            object.__setattr__(self, "ns_problem", (1, self.shape[0], self.shape[1]))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def problems(self) -> Tuple[Tuple[int, int, int], ...]:
        """``(batch, rows, cols)`` of each NS call the matrix takes: its parts', else ``ns_problem``."""
        return self.parts or (self.ns_problem, )

    @property
    def ns_workspace_numel(self) -> int:
        """fp32 elements NS allocates beyond its input where it computes in fp32 (``ns_workspace(4)``)."""
        return self.ns_workspace(4)

    def ns_workspace(self, itemsize: int = 4) -> int:
        """What NS allocates beyond its input, in fp32 elements, where the kernel computes in ``itemsize``-byte
        elements (``original_muon.ns_compute_dtype``: fp16 "gram" and bf16 "standard" on a GPU, fp32 on a CPU without
        them). Measured on the eager fp32 kernels, per problem (``m, n = min, max(rows, cols)``): ``2mn + 4m^2``
        ("gram") or ``4mn + 2m^2`` elements of ``itemsize`` bytes, counted in fp32 elements
        (``ceil(count * itemsize / 4)``); a fused parameter's parts run one shape at a time (the largest counts)
        between an fp32 stack of them and the result (twice its elements); plus ``extra_numel``."""
        per_mn, per_mm = (2, 4) if self.ns_method == "gram" else (4, 2)
        most = 0
        for batch, rows, cols in self.problems:
            m, n = min(rows, cols), max(rows, cols)
            most = max(most, batch * (per_mn * m * n + per_mm * m * m))
        kernel = -(-most * itemsize // 4)
        return kernel + (2 * self.numel if self.split else 0) + self.extra_numel


def newton_schulz_cost(spec: MatrixSpec, ns_steps: int = NS_STEPS_DEFAULT) -> float:
    """Approximate flops of one NS orthogonalization of ``spec``, for balancing (not a time). With ``m, n = min,
    max(rows, cols)``: the quintic iteration (upstream ``zeropower_via_newtonschulz5``; Polar Express costs the same)
    does ``X X^T``, ``A A`` and ``B X`` per step, ``4 m^2 n + 2 m^3``; the Gram variant
    (``zeropower_via_gram_newtonschulz``, for ``m < n``) forms ``X X^T`` once, iterates on the ``m x m`` Gram matrix
    (about ``6 m^3`` per step) and applies ``Q X`` twice.
    """
    cost = 0.0
    for batch, rows, cols in spec.problems:
        m, n = min(rows, cols), max(rows, cols)
        if spec.ns_method == "gram" and m < n:
            per_matrix = 3 * (2.0 * m * m * n) + ns_steps * 6.0 * m**3
        else:
            per_matrix = ns_steps * (4.0 * m * m * n + 2.0 * m**3)
        cost += batch * per_matrix
    return cost


@dataclass(frozen=True)
class OwnerPlan:
    """Owners and buckets of one partition's matrices (indices in partition order).

    Attributes:
        world_size, owners: ranks of the partition's process group; per matrix its owner rank.
        buckets: tuples of matrix indices, every matrix in exactly one.
        costs, workspaces, travels: per matrix ``newton_schulz_cost``, ``MatrixSpec.ns_workspace`` at the plan's NS
            itemsize and ``MatrixSpec.travels`` (empty: every matrix travels).
    """
    world_size: int
    owners: Tuple[int, ...]
    buckets: Tuple[Tuple[int, ...], ...]
    costs: Tuple[float, ...]
    workspaces: Tuple[int, ...] = ()
    travels: Tuple[bool, ...] = ()

    def workspace(self, rank: int) -> int:
        """NS elements ``rank`` needs as owner: its largest matrix's working set (calls batch up to it); 0 if none."""
        return max((w for owner, w in zip(self.owners, self.workspaces) if owner == rank), default=0)

    def load(self) -> List[float]:
        """NS cost each rank owns."""
        load = [0.0] * self.world_size
        for owner, cost in zip(self.owners, self.costs):
            load[owner] += cost
        return load

    def imbalance(self) -> float:
        """``max(load) / mean(load)`` (1.0: balanced; 0.0 for an empty plan)."""
        load = self.load()
        total = sum(load)
        return max(load) * self.world_size / total if total > 0 else 0.0

    def signature(self) -> List[int]:
        """The owners, then each matrix's bucket number: ranks compare these."""
        bucket_of = [0] * len(self.owners)
        for b, bucket in enumerate(self.buckets):
            for j in bucket:
                bucket_of[j] = b
        return list(self.owners) + bucket_of


class Uniform(Sequence):
    """ZeRO-3's pieces of one matrix: ``value`` elements on each of ``n`` ranks (``ceil(ds_numel / W)``, zero-padded),
    without a list of ``n`` entries; the planner's per-rank sums over such pieces take O(1) instead of O(W)."""

    def __init__(self, value: int, n: int):
        self.value, self.n = int(value), int(n)

    @classmethod
    def of(cls, pieces: Sequence[int]):
        """``pieces`` as a ``Uniform`` where every rank holds the same number of elements, else as given."""
        if isinstance(pieces, Uniform) or not pieces:
            return pieces
        first = pieces[0]
        return cls(first, len(pieces)) if all(p == first for p in pieces) else pieces

    def __len__(self):
        return self.n

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self.value] * len(range(*r.indices(self.n)))
        if not -self.n <= r < self.n:
            raise IndexError(r)
        return self.value

    def __iter__(self):
        return iter([self.value] * self.n)

    def __eq__(self, other):
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    def __repr__(self):
        return f"Uniform({self.value}, {self.n})"


def make_buckets(numels: Sequence[int], bucket_numel: int) -> Tuple[Tuple[int, ...], ...]:
    """Consecutive runs of matrices of at most ``bucket_numel`` elements (a larger matrix alone).

    Raises:
        ValueError: ``bucket_numel`` not positive (naming ``reduce_bucket_size``).
    """
    if bucket_numel <= 0:
        raise ValueError(f"zero_optimization.reduce_bucket_size must be positive, got {bucket_numel}.")
    buckets, current, current_numel = [], [], 0
    for j, numel in enumerate(numels):
        if current and current_numel + numel > bucket_numel:
            buckets.append(tuple(current))
            current, current_numel = [], 0
        current.append(j)
        current_numel += numel
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def make_cost_buckets(costs: Sequence[float], world_size: int, factor: float) -> Tuple[Tuple[int, ...], ...]:
    """Consecutive runs of matrices, each closed once its NS cost reaches ``factor x W x`` its largest matrix's
    cost: at ``factor`` 1 a bucket of equal matrices holds W of them, one NS problem per owner, so every owner
    computes at once; 0 puts every matrix alone, ``math.inf`` all in one bucket."""
    buckets, current, total, largest = [], [], 0.0, 0.0
    for j, cost in enumerate(costs):
        current.append(j)
        total, largest = total + cost, max(largest, cost)
        if total >= factor * world_size * largest:
            buckets.append(tuple(current))
            current, total, largest = [], 0.0, 0.0
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def plan_owners(specs: Sequence[MatrixSpec],
                world_size: int,
                bucket_numel: int,
                ns_steps: int = NS_STEPS_DEFAULT,
                initial_load: Optional[Sequence[float]] = None,
                holders: Optional[Sequence[Sequence[int]]] = None,
                buckets: Optional[Sequence[Sequence[int]]] = None,
                ns_itemsize: int = 4) -> OwnerPlan:
    """Assign an owner rank to every matrix (module docstring), deterministically. ``initial_load``: NS cost each rank
    owns in the group's earlier partitions (default zeros); ``holders``: per matrix the ranks holding a piece, one of
    which owns it (None: every rank); ``buckets``: default ``make_buckets`` at ``bucket_numel``; ``ns_itemsize``: bytes
    of the dtype NS computes in. Per bucket ``max(bin) <= sum(bucket) / W + max(cost in bucket)`` (LPT); heaps pick the
    least ``(load, index)`` bin or rank each time, O(n log W).

    Raises:
        ValueError: ``world_size < 1``, an ``initial_load`` of the wrong length, a matrix without holders.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if initial_load is not None and len(initial_load) != world_size:
        raise ValueError(f"initial_load has {len(initial_load)} entries for {world_size} ranks.")
    costs = tuple(newton_schulz_cost(spec, ns_steps) for spec in specs)
    if buckets is None:
        buckets = make_buckets([spec.numel for spec in specs], bucket_numel) if specs else ()
    buckets = tuple(tuple(b) for b in buckets)
    owners = [0] * len(specs)
    total_load = list(initial_load) if initial_load is not None else [0.0] * world_size
    if holders is not None:
        if len(holders) != len(specs) or not all(holders):
            raise ValueError("holders needs a non-empty list of ranks for every matrix.")
        for bucket in buckets:
            for j in sorted(bucket, key=lambda j: (-costs[j], j)):
                owners[j] = min(holders[j], key=lambda r: (total_load[r], r))
                total_load[owners[j]] += costs[j]
    else:
        ranks = [(load, r) for r, load in enumerate(total_load)]
        heapq.heapify(ranks)
        for bucket in buckets:
            # LPT into W bins: balances this bucket. Bins not used yet (load 0) come in index order.
            used, next_empty, bin_of, bin_load = [], 0, {}, {}
            for j in sorted(bucket, key=lambda j: (-costs[j], j)):
                if next_empty < world_size and (not used or (0.0, next_empty) < used[0]):
                    b = next_empty
                    next_empty += 1
                else:
                    _, b = heapq.heappop(used)
                bin_of[j] = b
                bin_load[b] = bin_load.get(b, 0.0) + costs[j]
                heapq.heappush(used, (bin_load[b], b))
            # heaviest bin to the rank with the least work so far: balances the whole plan
            bins = sorted(bin_load, key=lambda b: (-bin_load[b], b))
            least = [heapq.heappop(ranks) for _ in bins]
            rank_of_bin = {b: r for b, (_, r) in zip(bins, least)}
            for b, (load, r) in zip(bins, least):
                heapq.heappush(ranks, (load + bin_load[b], r))
            for j in bucket:
                owners[j] = rank_of_bin[bin_of[j]]
    return OwnerPlan(world_size, tuple(owners), buckets, costs,
                     tuple(spec.ns_workspace(ns_itemsize) for spec in specs), tuple(spec.travels for spec in specs))


def _largest_buffers(plan: OwnerPlan, pieces: Sequence[Sequence[int]]) -> Tuple[List[int], List[int]]:
    """Per rank, the elements of its largest outgoing and incoming bucket buffers (travelling matrices only; O(n + W)
    where every matrix's pieces are ``Uniform``, else O(n W))."""
    w = plan.world_size
    uniform = all(isinstance(p, Uniform) for p in pieces)
    most_out, most_in = [0] * w, [0] * w
    for bucket in plan.buckets:
        bucket = [j for j in bucket if not plan.travels or plan.travels[j]]  # in place: no buffer
        incoming = {}
        for j in bucket:
            whole = pieces[j].value * w if uniform else sum(pieces[j])
            incoming[plan.owners[j]] = incoming.get(plan.owners[j], 0) + whole
        if uniform:
            outgoing = sum(pieces[j].value for j in bucket)
            most_out = [outgoing] * w if outgoing > most_out[0] else most_out
        else:
            outgoing = [0] * w
            for j in bucket:
                for r, n in enumerate(pieces[j]):
                    outgoing[r] += n
            most_out = [max(a, b) for a, b in zip(most_out, outgoing)]
        for r, n in incoming.items():
            most_in[r] = max(most_in[r], n)
    return most_out, most_in


def reserved_numel(plan: OwnerPlan, pieces: Sequence[Sequence[int]], slots: int) -> List[int]:
    """Exchange-buffer elements each rank allocates for a step: ``slots`` buckets in flight of an outgoing (its
    pieces) and an incoming buffer (the pieces of the matrices it owns), each the largest bucket's."""
    most_out, most_in = _largest_buffers(plan, pieces)
    busy = min(slots, max(1, len(plan.buckets)))
    return [busy * (a + b) for a, b in zip(most_out, most_in)]


def rank_numels(plan: OwnerPlan,
                pieces: Sequence[Sequence[int]],
                slots: int,
                result_itemsize: int = 4,
                state_numels: Optional[Sequence[int]] = None) -> Tuple[List[int], List[int]]:
    """``(need, budget)`` per rank, in fp32 elements. ``need[r]``: what Muon adds on rank ``r`` at its step's peak,
    ``reserved_numel`` plus, as owner, its NS working set (``OwnerPlan.workspace``), its largest bucket's results where
    narrower than fp32 (``result_itemsize`` bytes; held until the bucket's calls are done) and a variant's state
    (``state_numels`` per matrix; None: plain Muon). ``budget[r]``: the elements it holds (its momentum partition)."""
    w = plan.world_size
    most_out, most_in = _largest_buffers(plan, pieces)
    held = [-(-n * result_itemsize // 4) if result_itemsize < 4 else 0 for n in most_in]
    state, workspace = [0] * w, [0] * w
    for owner, n in zip(plan.owners, plan.workspaces):
        workspace[owner] = max(workspace[owner], n)
    for owner, n in zip(plan.owners, state_numels or ()):
        state[owner] += n
    busy = min(slots, max(1, len(plan.buckets)))
    need = [busy * (a + b) + workspace[r] + held[r] + state[r] for r, (a, b) in enumerate(zip(most_out, most_in))]
    if all(isinstance(p, Uniform) for p in pieces):
        budget = [sum(p.value for p in pieces)] * w
    else:
        budget = [sum(p[r] for p in pieces) for r in range(w)]
    return need, budget


def within_budget(plan: OwnerPlan,
                  pieces: Sequence[Sequence[int]],
                  slots: int,
                  result_itemsize: int = 4,
                  state_numels: Optional[Sequence[int]] = None) -> bool:
    """Whether ``need <= budget`` on every rank (``rank_numels``): Muon's step then needs at its peak no more than
    the rank's momentum partition, as Adam's second moment."""
    need, budget = rank_numels(plan, pieces, slots, result_itemsize, state_numels)
    return all(n <= b for n, b in zip(need, budget))


def plan_within_budget(specs: Sequence[MatrixSpec],
                       pieces: Sequence[Sequence[int]],
                       world_size: int,
                       max_bucket_numel: int,
                       slots: int,
                       ns_steps: int = NS_STEPS_DEFAULT,
                       initial_load: Optional[Sequence[float]] = None,
                       holders: Optional[Sequence[Sequence[int]]] = None,
                       result_itemsize: int = 4,
                       state_numels: Optional[Sequence[int]] = None) -> OwnerPlan:
    """The strict rule (``STRICT``): ``plan_owners`` with the largest bucket size up to ``max_bucket_numel`` whose
    ranks' needs fit their limits: whole, else the first k matrices' totals by bisection (a fitting size, the largest
    where needs grow monotonically with it, as almost always), else every matrix alone. Rank ``r``'s limit is
    ``max(budget[r], alone[r])`` (``rank_numels`` at ``slots``; ``alone``: the every-matrix-alone plan's need, the
    least the pipeline can allocate), so where ``alone`` exceeds the budget (at ZeRO-3 the largest matrix's owner holds
    it whole plus its NS working set) buckets still group matrices wherever no rank needs more than that floor; the
    floor's matrix stays alone, as another in its bucket would add pieces to every outgoing buffer.

    Raises:
        ValueError: see ``plan_owners``.
    """

    def plan(numel):
        return plan_owners(specs, world_size, numel, ns_steps, initial_load, holders, ns_itemsize=result_itemsize)

    def needs(candidate):
        return rank_numels(candidate, pieces, slots, result_itemsize, state_numels)

    candidates, total = [], 0
    for spec in specs:
        total += spec.numel
        if total > max_bucket_numel:
            break
        candidates.append(total)
    best = plan(1)  # every matrix alone: the least the pipeline can allocate
    alone, budget = needs(best)
    limit = [max(b, a) for b, a in zip(budget, alone)]

    def fits(candidate):
        return all(n <= m for n, m in zip(needs(candidate)[0], limit))

    whole = plan(max_bucket_numel) if max_bucket_numel > total else None
    if whole is not None and fits(whole):
        return whole
    lo, hi = 0, len(candidates) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = plan(candidates[mid])
        if fits(candidate):
            best, lo = candidate, mid + 1
        else:
            hi = mid - 1
    return best


def slots_for_depth(depth: int) -> int:
    """Exchange-buffer slots the pipeline uses at ``depth`` (buckets in flight at once)."""
    return 2 * depth - 1


def plan_for_depth(specs: Sequence[MatrixSpec], pieces: Sequence[Sequence[int]], world_size: int,
                   max_bucket_numel: int, depth: int, **plan_args) -> Tuple[OwnerPlan, int]:
    """The strict rule's ``(plan, depth)``: ``plan_within_budget`` at ``depth``'s slots, lowering the depth while its
    plan does not fit ``within_budget``; at depth 1 its plan whatever it needs. Where even every matrix alone exceeds
    the budget the depth falls to 1 on purpose: depth ``d`` allocates ``2d - 1`` buckets' buffers, so depth 1 has the
    least peak of any plan, and its buckets are the floor-relative ones. ``plan_args``: ``ns_steps``, ``initial_load``,
    ``holders``, ``result_itemsize``, ``state_numels``."""
    pieces = [Uniform.of(p) for p in pieces]
    for d in range(depth, 0, -1):
        plan = plan_within_budget(specs, pieces, world_size, max_bucket_numel, slots_for_depth(d), **plan_args)
        if within_budget(plan, pieces, slots_for_depth(d), plan_args.get("result_itemsize", 4),
                         plan_args.get("state_numels")):
            return plan, d
    return plan, 1


DEFAULT_MAX_STEP_MEMORY = 8 * 2**30
"""``max_step_memory``'s default, bytes (8 GiB): 10 % of an 80 GB H100's memory, which the step borrows after the
backward pass has freed its activations; enough for depth 2 on a Llama-3 70B (28672 x 8192 matrices: about 7 GiB),
while smaller models take only what every owner computing at once needs (Llama-3 8B: about 1.8 GiB)."""

STRICT = "momentum_partition"
"""``max_step_memory``'s strict value: Muon's step within each rank's momentum partition (as Adam's second moment),
or the least any plan needs where that is larger (``plan_for_depth``); buckets bounded by ``reduce_bucket_size``."""

BUCKET_FACTORS = (math.inf, 8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.0)
"""The ``make_cost_buckets`` factors ``plan_within_cap`` tries: all in one bucket .. every matrix alone."""

EFFICIENCY_GOAL = 0.9
"""``plan_within_cap`` chooses among the fitting plans whose ``critical_path`` is at most ``max(ideal_path /
EFFICIENCY_GOAL, 1.05 * the best fitting plan's)``: near the ideal where a plan gets there, else near the best."""

MIN_SEND_NUMEL = 16 * 2**20
"""fp32 elements (64 MiB) a rank should send per bucket on average: smaller buckets pay more in all-to-all start-up
(tens of microseconds each, more with many peers) than their extra overlap saves, so ``plan_within_cap`` takes more
buckets only while they stay this large (``bench/scale.py``: 4M elements gave Qwen3-30B-A3B 581 buckets at W=8 and
5.2 % of forward+backward at W=256, 16M 226 buckets and 3.9 %; the Llama-3 plans are the same under both)."""


class CapBelowFloor(ValueError):
    """Even every matrix alone at pipeline depth 1 needs more than the cap (``cap_numel``) on some rank:
    ``needed_numel`` fp32 elements on its busiest rank, the least any plan needs.
    """

    def __init__(self, needed_numel: int, cap_numel: int):
        self.needed_numel, self.cap_numel = needed_numel, cap_numel
        super().__init__(f"Muon's step needs at least {4 * needed_numel} bytes on a rank (every matrix alone, "
                         f"pipeline depth 1), above the cap of {4 * cap_numel} bytes.")


def critical_path(plan: OwnerPlan) -> float:
    """NS cost on the step's critical path: per bucket its busiest owner's, summed (owners of one bucket compute at
    once; buckets follow each other)."""
    path = 0.0
    for bucket in plan.buckets:
        load = {}
        for j in bucket:
            load[plan.owners[j]] = load.get(plan.owners[j], 0.0) + plan.costs[j]
        path += max(load.values(), default=0.0)
    return path


def ideal_path(costs: Sequence[float], world_size: int) -> float:
    """The least NS critical path of ``costs`` over W ranks: ``max(sum / W, largest)``."""
    return max(sum(costs) / world_size, max(costs, default=0.0))


def plan_within_cap(specs: Sequence[MatrixSpec],
                    pieces: Sequence[Sequence[int]],
                    world_size: int,
                    cap_numel: int,
                    depth: int,
                    ns_steps: int = NS_STEPS_DEFAULT,
                    initial_load: Optional[Sequence[float]] = None,
                    holders: Optional[Sequence[Sequence[int]]] = None,
                    result_itemsize: int = 4,
                    state_numels: Optional[Sequence[int]] = None) -> Tuple[OwnerPlan, int]:
    """``(plan, depth)`` in which every owner computes at once, within ``cap_numel`` fp32 elements per rank. Buckets
    are cut by NS cost (``make_cost_buckets`` at each of ``BUCKET_FACTORS``), owners balanced per bucket
    (``plan_owners``); a plan fits where every rank's ``rank_numels`` need at its depth's slots is at most
    ``cap_numel``. Of the fitting plans at depths ``depth`` down to 1 whose ``critical_path`` is within
    ``EFFICIENCY_GOAL``'s bound, those at the deepest such depth (exchange overlaps NS); of these, the one with the
    most buckets (least memory, most overlap) whose ranks still send ``MIN_SEND_NUMEL`` per bucket on average, else the
    fewest. ``reduce_bucket_size`` plays no part.

    Raises:
        CapBelowFloor: no plan fits.
        ValueError: ``depth`` below 1; see ``plan_owners``.
    """
    if depth < 1:
        raise ValueError(f"the Muon pipeline depth must be at least 1, got {depth}")
    pieces = [Uniform.of(p) for p in pieces]
    costs = [newton_schulz_cost(spec, ns_steps) for spec in specs]
    fitting, seen = [], {}
    floor = None
    for d in range(depth, 0, -1):
        for factor in BUCKET_FACTORS:
            buckets = make_cost_buckets(costs, world_size, factor)
            if buckets not in seen:
                seen[buckets] = plan_owners(specs, world_size, 0, ns_steps, initial_load, holders, buckets,
                                            result_itemsize)
            plan = seen[buckets]
            need = max(rank_numels(plan, pieces, slots_for_depth(d), result_itemsize, state_numels)[0], default=0)
            if d == 1 and factor == 0.0:
                floor = need
            if need <= cap_numel:
                fitting.append((d, plan, critical_path(plan)))
    if not fitting:
        raise CapBelowFloor(floor, cap_numel)
    best = min(path for _, _, path in fitting)
    good = max(ideal_path(costs, world_size) / EFFICIENCY_GOAL, 1.05 * best)
    depth = max(d for d, _, path in fitting if path <= good)
    chosen = [(plan, path) for d, plan, path in fitting if d == depth and path <= good]
    sent = sum(spec.numel for spec in specs) / world_size  # per rank over the step, whatever the buckets
    large = [c for c in chosen if sent >= MIN_SEND_NUMEL * len(c[0].buckets)]
    if large:
        return max(large, key=lambda c: (len(c[0].buckets), -c[1]))[0], depth
    return min(chosen, key=lambda c: (len(c[0].buckets), c[1]))[0], depth


def floor_numel(specs: Sequence[MatrixSpec],
                pieces: Sequence[Sequence[int]],
                world_size: int,
                ns_steps: int = NS_STEPS_DEFAULT,
                holders: Optional[Sequence[Sequence[int]]] = None,
                result_itemsize: int = 4,
                state_numels: Optional[Sequence[int]] = None,
                initial_load: Optional[Sequence[float]] = None) -> int:
    """What every matrix alone at depth 1 needs on its busiest rank, fp32 elements: the least of the plans
    ``plan_within_cap`` considers, the figure ``CapBelowFloor`` gives (same arguments, same figure)."""
    pieces = [Uniform.of(p) for p in pieces]
    alone = plan_owners(specs, world_size, 1, ns_steps, initial_load, holders, ns_itemsize=result_itemsize)
    return max(rank_numels(alone, pieces, 1, result_itemsize, state_numels)[0], default=0)


def plan_partition(specs: Sequence[MatrixSpec], pieces: Sequence[Sequence[int]], world_size: int, max_step_memory,
                   max_bucket_numel: int, depth: int, **plan_args) -> Tuple[OwnerPlan, int]:
    """``(plan, depth)`` of one partition under ``max_step_memory``: bytes (``plan_within_cap`` at ``bytes // 4``
    elements) or ``STRICT`` (``plan_for_depth``, buckets of at most ``max_bucket_numel``; ``plan_args`` as for it).

    Raises:
        CapBelowFloor, ValueError: see ``plan_within_cap``."""
    if max_step_memory == STRICT:
        return plan_for_depth(specs, pieces, world_size, max_bucket_numel, depth, **plan_args)
    return plan_within_cap(specs, pieces, world_size, int(max_step_memory) // 4, depth, **plan_args)


@dataclass(frozen=True)
class PlanFigures:
    """One step's figures for a set of partitions' plans, every rank counted (the plan report's and init log's).

    Attributes:
        world_size, buckets, depth: ranks; buckets over all partitions; the least pipeline depth among them (one
            bucket counts as 1: nothing overlaps).
        peak_bytes: largest ``rank_numels`` need of any rank and partition (one partition's buffers live at a time).
        kept_bytes: the most any rank keeps between steps (fp32 momentum of its pieces plus a variant's owner state).
        ns_efficiency: ``ideal_path`` of every matrix over ``critical_path`` summed over partitions (1: every owner
            computes at once; 1 / buckets: one at a time).
    """
    world_size: int
    buckets: int
    depth: int
    peak_bytes: int
    kept_bytes: int
    ns_efficiency: float


def plan_figures(entries: Sequence[tuple], world_size: int) -> PlanFigures:
    """``PlanFigures`` of ``entries``, each ``(plan, depth, pieces, result_itemsize, state_numels or None)``."""
    peak, kept, path, costs = 0, [0] * world_size, 0.0, []
    for plan, depth, pieces, itemsize, state in entries:
        pieces = [Uniform.of(p) for p in pieces]
        need, budget = rank_numels(plan, pieces, slots_for_depth(depth), itemsize, state)
        peak = max(peak, max(need, default=0))
        kept = [k + b for k, b in zip(kept, budget)]
        for owner, n in zip(plan.owners, state or ()):
            kept[owner] += n
        path += critical_path(plan)
        costs += plan.costs
    ideal = ideal_path(costs, world_size)
    depth = min((min(e[1], max(1, len(e[0].buckets))) for e in entries), default=0)  # one bucket overlaps nothing
    return PlanFigures(world_size, sum(len(e[0].buckets) for e in entries), depth, 4 * peak, 4 * max(kept, default=0),
                       ideal / path if path > 0 else 1.0)


DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
"""``zero_optimization.sub_group_size``'s default."""
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000
"""``zero_optimization.reduce_bucket_size``'s default."""


def zero3_sub_groups(specs: Sequence, world_size: int, sub_group_size: int) -> List[list]:
    """ZeRO-3's sub-groups of one parameter group: consecutive matrices until a rank's partition elements reach
    ``sub_group_size`` (stage 3's ``_create_fp16_sub_groups``); each ``(indices, pieces, holders)``."""
    groups, current, held = [], [], 0
    for j, spec in enumerate(specs):
        current.append(j)
        held += math.ceil(spec.numel / world_size)
        if held >= sub_group_size:
            groups.append(current)
            current, held = [], 0
    if current:
        groups.append(current)
    return [(g, [Uniform(math.ceil(specs[j].numel / world_size), world_size) for j in g], None) for g in groups]


def zero12_partition(specs: Sequence, world_size: int) -> List[list]:
    """ZeRO-1/2's flat buffer of the Muon group cut in W equal partitions: per matrix the elements of it each rank
    holds; ``holders`` the ranks with any (one partition of the whole group)."""
    size = math.ceil(sum(s.numel for s in specs) / world_size)
    pieces, holders, start = [], [], 0
    for spec in specs:
        end = start + spec.numel
        piece = tuple(max(0, min(end, (r + 1) * size) - max(start, r * size)) for r in range(world_size))
        pieces.append(piece)
        holders.append([r for r, n in enumerate(piece) if n])
        start = end
    every = all(len(h) == world_size for h in holders)
    return [(list(range(len(specs))), pieces, None if every else holders)]


def plan_partitions(specs: Sequence,
                    world_size: int,
                    stage: int = 3,
                    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
                    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE,
                    max_step_memory=DEFAULT_MAX_STEP_MEMORY,
                    depth: int = 2,
                    ns_itemsize: int = 2,
                    variant=None) -> list:
    """Per partition ``(indices, plan, depth, pieces, ns_itemsize, state_numels, holders, floor)``, planned as
    ``binding.MuonUpdate`` does (NS cost carried over between partitions; ``floor``: ``floor_numel``).

    Raises:
        owner_plan.CapBelowFloor: ``max_step_memory`` below what a partition needs with every matrix alone.
    """
    parts = zero3_sub_groups(specs, world_size, sub_group_size) if stage == 3 else zero12_partition(specs, world_size)
    load, out = [0.0] * world_size, []
    for indices, pieces, holders in parts:
        # one holder orthogonalizes in place (pieces on the NS device: no optimizer offload)
        chosen = [dataclasses.replace(specs[j], travels=sum(map(bool, p)) > 1) for j, p in zip(indices, pieces)]
        state = [variant.state_numel(s) for s in chosen] if variant is not None else None
        plan_args = dict(initial_load=load, holders=holders, result_itemsize=ns_itemsize, state_numels=state)
        plan, d = plan_partition(chosen, pieces, world_size, max_step_memory, reduce_bucket_size, depth, **plan_args)
        floor = floor_numel(chosen, pieces, world_size, **plan_args)
        load = [a + b for a, b in zip(load, plan.load())]
        out.append((indices, plan, d, pieces, ns_itemsize, state, holders, floor))
    return out
