# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which rank orthogonalizes which Muon matrix: the owner plan (pure Python, no torch).

Every rank builds the same plan from the same matrix shapes, so the plan is never communicated
(the binding checks once, at initialization, that the ranks agree). Terms:

- *pieces*: ``pieces[r]``, the elements of a matrix's flattened gradient rank ``r`` holds (rank
  order). ZeRO-3: ``ceil(ds_numel / W)`` on every rank, zero-padded; ZeRO-1/2: the run of the flat
  buffer each partition covers, so most matrices have one holder.
- *owner rank*: the rank that receives every piece of a matrix's Newton-Schulz (NS) input, runs NS
  once on the whole matrix and sends each rank its piece of the result.
- *bucket*: consecutive matrices of at most ``reduce_bucket_size`` elements in all (a larger
  matrix alone), exchanged together; buckets bound the exchange buffers.

Owners are balanced by NS cost per bucket: greedy longest-processing-time-first into W bins (LPT,
Graham 1969, "Bounds on multiprocessing timing anomalies"), since every rank waits for the
slowest owner of a bucket; then the heaviest bin goes to the rank with the least work so far, so
the totals stay balanced too. A matrix only some ranks hold goes to the least loaded of them.
``plan_within_budget`` picks the largest bucket size whose exchange buffers and owner working set
fit each rank's momentum partition: Muon then keeps no more memory than Adam's second moment. Where
even every matrix alone exceeds it (the largest matrix's owner holds it whole plus its NS working
set), the bucket size is chosen against that floor instead: a rank may need up to the larger of
its partition and what it needs with every matrix alone, so buckets keep several owners busy at
once and the job's peak stays that of every matrix alone.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

NS_STEPS_DEFAULT = 5
"""Newton-Schulz iterations upstream ``muon_update`` runs (its ``ns_steps`` default)."""


@dataclass(frozen=True)
class MatrixSpec:
    """One Muon parameter as the plan sees it.

    Attributes:
        shape: the full shape (ZeRO-3: ``ds_shape``), at least 2-D.
        ns_method: the group's ``ns_method``.
        is_expert_group, num_heads: the parameter's ``is_expert_group`` and ``muon_num_heads``.
        ns_problem: ``(batch, rows, cols)`` of the matrices NS runs on (upstream
            ``original_muon.muon_ns_problem``); may be omitted for a 2-D matrix without heads.
        split, parts: a fused parameter's ``(dim, sizes)`` (``newton_schulz.SPLIT_ATTR``) and the
            ``(batch, rows, cols)`` of its parts per distinct shape; None and () for one matrix.
        extra_numel: elements the owner allocates around NS besides (a spread matrix's storage and whole copy).

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

    def __post_init__(self):
        if self.ns_problem is None:
            if len(self.shape) != 2 or self.num_heads is not None:
                raise ValueError(f"MatrixSpec of shape {tuple(self.shape)} (num_heads={self.num_heads}) needs its "
                                 "ns_problem (original_muon.muon_ns_problem); only a 2-D matrix without heads is "
                                 "one problem of its own shape.")
            object.__setattr__(self, "ns_problem", (1, self.shape[0], self.shape[1]))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def problems(self) -> Tuple[Tuple[int, int, int], ...]:
        """``(batch, rows, cols)`` of each NS call the matrix takes: its parts', else ``ns_problem``."""
        return self.parts or (self.ns_problem, )

    @property
    def ns_workspace_numel(self) -> int:
        """Elements NS allocates beyond its input (the eager fp32 kernels' peak, measured): per problem
        ``2mn + 4m^2`` for "gram", ``4mn + 2m^2`` otherwise (``m, n = min, max(rows, cols)``); a fused
        parameter's parts run one shape at a time (the largest counts) between a stack of them and the result
        (twice its elements); plus ``extra_numel``."""
        most = 0
        for batch, rows, cols in self.problems:
            m, n = min(rows, cols), max(rows, cols)
            if self.ns_method == "gram":
                most = max(most, batch * (2 * m * n + 4 * m * m))
            else:
                most = max(most, batch * (4 * m * n + 2 * m * m))
        return most + (2 * self.numel if self.split else 0) + self.extra_numel


def newton_schulz_cost(spec: MatrixSpec, ns_steps: int = NS_STEPS_DEFAULT) -> float:
    """Approximate flops of one NS orthogonalization of ``spec``, for balancing (not a time).

    With ``m, n = min, max(rows, cols)``: the quintic iteration (upstream
    ``zeropower_via_newtonschulz5``; Polar Express costs the same) does ``X X^T``, ``A A`` and
    ``B X`` per step, ``4 m^2 n + 2 m^3``; the Gram variant (``zeropower_via_gram_newtonschulz``,
    for ``m < n``) forms ``X X^T`` once, iterates on the ``m x m`` Gram matrix (about ``6 m^3`` per
    step) and applies ``Q X`` twice.
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
        world_size: ranks of the partition's process group.
        owners: owner rank per matrix.
        buckets: each a tuple of matrix indices; every matrix in exactly one.
        costs, workspaces: per matrix, ``newton_schulz_cost`` and ``ns_workspace_numel``.
    """
    world_size: int
    owners: Tuple[int, ...]
    buckets: Tuple[Tuple[int, ...], ...]
    costs: Tuple[float, ...]
    workspaces: Tuple[int, ...] = ()

    def workspace(self, rank: int) -> int:
        """NS working set (elements) ``rank`` needs as owner: its largest matrix's (calls are batched
        only up to that), 0 where it owns none."""
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


def plan_owners(specs: Sequence[MatrixSpec],
                world_size: int,
                bucket_numel: int,
                ns_steps: int = NS_STEPS_DEFAULT,
                initial_load: Optional[Sequence[float]] = None,
                holders: Optional[Sequence[Sequence[int]]] = None) -> OwnerPlan:
    """Assign an owner rank to every matrix (module docstring); deterministic in its inputs.

    ``initial_load``: NS cost each rank owns in earlier partitions of the group (zeros if omitted);
    ``holders``: per matrix the ranks holding a piece, its owner one of them (None: every rank).
    Per bucket ``max(bin) <= sum(bucket) / W + max(cost in bucket)`` (LPT).

    Raises:
        ValueError: ``world_size < 1``, an ``initial_load`` of the wrong length, a matrix without holders.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if initial_load is not None and len(initial_load) != world_size:
        raise ValueError(f"initial_load has {len(initial_load)} entries for {world_size} ranks.")
    costs = tuple(newton_schulz_cost(spec, ns_steps) for spec in specs)
    workspaces = tuple(spec.ns_workspace_numel for spec in specs)
    buckets = make_buckets([spec.numel for spec in specs], bucket_numel) if specs else ()
    owners = [0] * len(specs)
    total_load = list(initial_load) if initial_load is not None else [0.0] * world_size
    if holders is not None:
        if len(holders) != len(specs) or not all(holders):
            raise ValueError("holders needs a non-empty list of ranks for every matrix.")
        for bucket in buckets:
            for j in sorted(bucket, key=lambda j: (-costs[j], j)):
                owners[j] = min(holders[j], key=lambda r: (total_load[r], r))
                total_load[owners[j]] += costs[j]
        return OwnerPlan(world_size, tuple(owners), buckets, costs, workspaces)
    for bucket in buckets:
        bin_of, bin_load = {}, [0.0] * world_size  # LPT into W bins: balances this bucket
        for j in sorted(bucket, key=lambda j: (-costs[j], j)):
            b = min(range(world_size), key=lambda b: (bin_load[b], b))
            bin_of[j] = b
            bin_load[b] += costs[j]
        # heaviest bin to the rank with the least work so far: balances the whole plan
        bins = sorted(range(world_size), key=lambda b: (-bin_load[b], b))
        ranks = sorted(range(world_size), key=lambda r: (total_load[r], r))
        rank_of_bin = dict(zip(bins, ranks))
        for j in bucket:
            owners[j] = rank_of_bin[bin_of[j]]
        for b, r in rank_of_bin.items():
            total_load[r] += bin_load[b]
    return OwnerPlan(world_size, tuple(owners), buckets, costs, workspaces)


def _largest_buffers(plan: OwnerPlan, pieces: Sequence[Sequence[int]]) -> Tuple[List[int], List[int]]:
    """Per rank, the elements of its largest outgoing and of its largest incoming bucket buffer."""
    most_out, most_in = [0] * plan.world_size, [0] * plan.world_size
    for bucket in plan.buckets:
        outgoing, incoming = [0] * plan.world_size, [0] * plan.world_size
        for j in bucket:
            for r, n in enumerate(pieces[j]):
                outgoing[r] += n
            incoming[plan.owners[j]] += sum(pieces[j])
        most_out = [max(a, b) for a, b in zip(most_out, outgoing)]
        most_in = [max(a, b) for a, b in zip(most_in, incoming)]
    return most_out, most_in


def reserved_numel(plan: OwnerPlan, pieces: Sequence[Sequence[int]], slots: int) -> List[int]:
    """Exchange-buffer elements each rank reserves: ``slots`` buckets in flight of an outgoing (its
    pieces) and an incoming buffer (the pieces of the matrices it owns), each the largest bucket's."""
    most_out, most_in = _largest_buffers(plan, pieces)
    busy = min(slots, max(1, len(plan.buckets)))
    return [busy * (a + b) for a, b in zip(most_out, most_in)]


def rank_numels(plan: OwnerPlan,
                pieces: Sequence[Sequence[int]],
                slots: int,
                result_itemsize: int = 4,
                state_numels: Optional[Sequence[int]] = None) -> Tuple[List[int], List[int]]:
    """``(need, budget)`` per rank, in elements (fp32: 4 bytes each). ``need[r]``: what Muon adds on
    rank ``r`` at the peak of its step, ``reserved_numel`` plus, as owner, its NS working set
    (``OwnerPlan.workspace``), its largest bucket's results where they are narrower than fp32
    (``result_itemsize`` bytes; held until the bucket's calls are done: ``ceil(n * itemsize / 4)``)
    and a variant's state of its matrices (``state_numels`` per matrix; None for plain Muon).
    ``budget[r]``: the elements it holds, ``sum(p[r] for p in pieces)`` (its momentum partition)."""
    _, most_in = _largest_buffers(plan, pieces)
    held = [-(-n * result_itemsize // 4) if result_itemsize < 4 else 0 for n in most_in]
    state = [0] * plan.world_size
    for owner, n in zip(plan.owners, state_numels or ()):
        state[owner] += n
    reserved = reserved_numel(plan, pieces, slots)
    need = [reserved[r] + plan.workspace(r) + held[r] + state[r] for r in range(plan.world_size)]
    budget = [sum(p[r] for p in pieces) for r in range(plan.world_size)]
    return need, budget


def within_budget(plan: OwnerPlan,
                  pieces: Sequence[Sequence[int]],
                  slots: int,
                  result_itemsize: int = 4,
                  state_numels: Optional[Sequence[int]] = None) -> bool:
    """Whether every rank's reserved buffers and owner allocations fit the elements it holds (its
    momentum partition): Muon then keeps, and needs at the peak of its step, no more than Adam's
    second moment. ``need <= budget`` rank by rank (``rank_numels``: the terms)."""
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
    """``plan_owners`` with the largest bucket size (at most ``max_bucket_numel``) whose ranks' needs
    fit their limits: whole, else the first k matrices' totals by bisection (a fitting size; the
    largest where needs grow monotonically with it, as almost always), else every matrix alone.

    The limit of rank ``r`` is ``max(budget[r], alone[r])`` (``rank_numels`` at ``slots``; ``alone``: the need of
    the every-matrix-alone plan, the least the pipeline can reserve): the budget where that plan fits it. Where it
    does not (at ZeRO-3 the largest matrix's owner holds it whole plus its NS working set: Llama-3 8B's 14336x4096
    at W=32 needs 1.8M + 58.7M + 184.5M elements against a 218M partition), buckets still hold several matrices,
    so several owners compute at once, wherever no rank needs more than that floor (8B at W=32: 122 buckets, not
    224). The floor's matrix stays alone: another matrix in its bucket adds pieces to every outgoing buffer.

    Raises:
        ValueError: see ``plan_owners``.
    """

    def plan(bucket_numel):
        return plan_owners(specs, world_size, bucket_numel, ns_steps, initial_load, holders)

    def needs(candidate):
        return rank_numels(candidate, pieces, slots, result_itemsize, state_numels)

    candidates, total = [], 0
    for spec in specs:
        total += spec.numel
        if total > max_bucket_numel:
            break
        candidates.append(total)
    whole = plan(max_bucket_numel) if max_bucket_numel > total else None
    if whole is not None:
        need, budget = needs(whole)
        if all(n <= b for n, b in zip(need, budget)):
            return whole
    best = plan(1)  # every matrix alone: the least the pipeline can reserve
    alone, budget = needs(best)
    limit = [max(b, a) for b, a in zip(budget, alone)]

    def fits(candidate):
        return all(n <= m for n, m in zip(needs(candidate)[0], limit))

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
    """``(plan, depth)``: ``plan_within_budget`` at ``depth``'s slots, lowering the depth while its
    plan does not fit ``within_budget``; at depth 1 its plan whatever it needs.

    Where even every matrix alone exceeds the budget the depth falls to 1 on purpose: a floor at depth ``d``
    reserves ``2d - 1`` buckets' buffers, depth 1's is the least peak any plan has (``bench/model.py``'s
    ``zero3_owner_floor_numel``), and its buckets are the floor-relative ones (``plan_within_budget``).
    ``plan_args``: ``ns_steps``, ``initial_load``, ``holders``, ``result_itemsize``, ``state_numels``."""
    for d in range(depth, 0, -1):
        plan = plan_within_budget(specs, pieces, world_size, max_bucket_numel, slots_for_depth(d), **plan_args)
        if within_budget(plan, pieces, slots_for_depth(d), plan_args.get("result_itemsize", 4),
                         plan_args.get("state_numels")):
            return plan, d
    return plan, 1
