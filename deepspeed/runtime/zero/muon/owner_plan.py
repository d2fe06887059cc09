# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which rank orthogonalizes which Muon matrix: the owner plan.

Pure Python, no torch and no processes: every rank builds the same plan from the same list of
matrix shapes, so the plan never has to be communicated (the binding only checks, once at
initialization, that all ranks agree). The Newton-Schulz problems of each matrix, which the cost
model needs, come from the caller (upstream ``original_muon.muon_ns_problem``, the function the
orthogonalization itself takes its views from).

Terms:
- *pieces*: ``pieces[r]`` is how many elements of a matrix's flattened gradient rank ``r`` holds,
  in rank order. Under ZeRO-3 every rank holds ``ceil(ds_numel / W)`` elements of each parameter,
  zero-padded past ``ds_numel``; under ZeRO-1/2 with optimizer offload each rank holds the slice
  of the flat buffer its partition covers, so most matrices have one holder.
- *owner rank*: the one rank that receives every partition of a matrix's Newton-Schulz (NS) input,
  runs NS once on the whole matrix, and sends each rank its partition of the result.
- *bucket*: a run of consecutive matrices whose total ``ds_numel`` is at most the bucket size
  (``reduce_bucket_size``); one bucket is exchanged at a time, which bounds the extra memory. A
  matrix larger than the bucket size gets a bucket of its own.

Owners are assigned per bucket in two moves. First the bucket's matrices are split into W bins
by greedy longest-processing-time-first (LPT, Graham 1969, "Bounds on multiprocessing timing
anomalies"): each matrix, most expensive first, goes to the bin with the least NS work. Balancing
within a bucket keeps the ranks busy together, since every rank waits for the slowest owner of a
bucket before its results come back. Then the heaviest bin goes to the rank with the least work
over all buckets so far, the next heaviest to the next, so that the totals stay balanced too
(a bucket holding one large matrix sends it to the least loaded rank). Where only some ranks
hold a piece of a matrix (``holders``), it goes to the least loaded of them instead.

The exchange buffers every rank reserves follow from the plan (``reserved_numel``), and
``plan_within_budget`` picks the largest bucket size whose buffers, with the owner's
Newton-Schulz working set, fit a budget (the momentum partition: Muon then keeps no more than
Adam's two moments, and needs no more at the peak of its step).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

NS_STEPS_DEFAULT = 5
"""Newton-Schulz iterations upstream ``muon_update`` runs (its ``ns_steps`` default)."""


@dataclass(frozen=True)
class MatrixSpec:
    """One Muon parameter of a sub-group, as the plan sees it.

    Attributes:
        shape: the full parameter shape (``param.ds_shape``), at least 2-D.
        ns_method: ``"gram"``, ``"standard"`` or ``"polar_express"`` (the parameter group's
            ``ns_method``).
        is_expert_group: ``param.is_expert_group``; NS is batched over the leading dimensions.
        num_heads: ``param.muon_num_heads``; NS runs per attention head (rows split into heads).
        ns_problem: ``(batch, rows, cols)``, the matrices Newton-Schulz runs on for this
            parameter, as upstream ``original_muon.muon_ns_problem`` gives them (the plan does
            not restate that dispatch). May be omitted for a 2-D matrix without heads: one
            problem of its own shape.

    Raises:
        ValueError: ``ns_problem`` omitted for a tensor that is not 2-D or has ``num_heads``.
    """
    shape: Tuple[int, ...]
    ns_method: str = "gram"
    is_expert_group: bool = False
    num_heads: Optional[int] = None
    ns_problem: Optional[Tuple[int, int, int]] = None

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
    def ns_workspace_numel(self) -> int:
        """Elements Newton-Schulz allocates for this parameter beyond its input: per problem, with
        ``m = min(rows, cols)`` and ``n = max(rows, cols)``, ``2 m n + 4 m^2`` for ``"gram"`` (the
        normalized copy and the result, and at most four ``m x m`` Gram and iteration matrices) and
        ``4 m n + 2 m^2`` for the iterations on the whole matrix, ``"standard"`` and
        ``"polar_express"`` (the iterate, ``a X``, ``B X`` and their sum, beside ``A = X X^T`` and
        ``B``). Measured as the allocator's peak above the input of the eager kernels in fp32 on the
        CPU: exactly these; a half-precision kernel needs fewer bytes, a compiled one fuses
        temporaries."""
        batch, rows, cols = self.ns_problem
        m, n = min(rows, cols), max(rows, cols)
        if self.ns_method == "gram":
            return batch * (2 * m * n + 4 * m * m)
        return batch * (4 * m * n + 2 * m * m)


def newton_schulz_cost(spec: MatrixSpec, ns_steps: int = NS_STEPS_DEFAULT) -> float:
    """Approximate floating-point operations of one Newton-Schulz orthogonalization of ``spec``.

    With ``m = min(rows, cols)`` and ``n = max(rows, cols)`` (NS works on the wide orientation):
    the standard quintic iteration (upstream ``zeropower_via_newtonschulz5``) costs per step
    ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2 m^2 n). The Gram variant (upstream
    ``zeropower_via_gram_newtonschulz``, used when ``m < n``) forms ``X X^T`` once, iterates on the
    ``m x m`` Gram matrix (about 6 m^3 per step) and applies ``Q X`` twice (restart and end). Polar
    Express (``polar_express``) is the standard iteration with other coefficients: the same cost.

    Returns:
        float: the operation count (a cost for balancing, not a time).
    """
    batch, rows, cols = spec.ns_problem
    m, n = min(rows, cols), max(rows, cols)
    if spec.ns_method == "gram" and m < n:
        per_matrix = 3 * (2.0 * m * m * n) + ns_steps * 6.0 * m**3
    else:
        per_matrix = ns_steps * (4.0 * m * m * n + 2.0 * m**3)
    return batch * per_matrix


@dataclass(frozen=True)
class OwnerPlan:
    """The owner of every matrix of one sub-group and how the matrices are bucketed.

    Attributes:
        world_size: ranks in the sub-group's partition process group (W).
        owners: ``owners[j]`` is the owner rank of matrix ``j`` (sub-group order).
        buckets: tuple of buckets, each a tuple of matrix indices in sub-group order; every matrix
            is in exactly one bucket.
        costs: ``costs[j]`` is ``newton_schulz_cost`` of matrix ``j``.
        workspaces: ``workspaces[j]`` is ``MatrixSpec.ns_workspace_numel`` of matrix ``j``.
    """
    world_size: int
    owners: Tuple[int, ...]
    buckets: Tuple[Tuple[int, ...], ...]
    costs: Tuple[float, ...]
    workspaces: Tuple[int, ...] = ()

    def workspace(self, rank: int) -> int:
        """Elements of Newton-Schulz working set ``rank`` needs as owner: its largest matrix's
        (the owner batches calls only up to that size), 0 where it owns none."""
        return max((w for owner, w in zip(self.owners, self.workspaces) if owner == rank), default=0)

    def load(self) -> List[float]:
        """NS cost each rank owns, summed over all buckets (list of length ``world_size``)."""
        load = [0.0] * self.world_size
        for owner, cost in zip(self.owners, self.costs):
            load[owner] += cost
        return load

    def imbalance(self) -> float:
        """``max(load) / mean(load)``: 1.0 is perfect balance; 0.0 for an empty plan."""
        load = self.load()
        total = sum(load)
        return max(load) * self.world_size / total if total > 0 else 0.0

    def signature(self) -> List[int]:
        """Integers that identify the plan: the owners, then each matrix's bucket number.

        Ranks compare these to check that they built the same plan.
        """
        bucket_of = [0] * len(self.owners)
        for b, bucket in enumerate(self.buckets):
            for j in bucket:
                bucket_of[j] = b
        return list(self.owners) + bucket_of


def make_buckets(numels: Sequence[int], bucket_numel: int) -> Tuple[Tuple[int, ...], ...]:
    """Split matrices ``0..len(numels)-1`` into consecutive runs of at most ``bucket_numel`` elements.

    A matrix with more elements than ``bucket_numel`` forms a bucket on its own.

    Raises:
        ValueError: if ``bucket_numel`` is not positive (the message names ``reduce_bucket_size``).
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
    """Assign an owner rank to every matrix of a sub-group; deterministic in its inputs.

    Args:
        specs: the sub-group's Muon matrices, in sub-group order.
        world_size: ranks in the sub-group's partition process group.
        bucket_numel: most full-matrix elements per exchange bucket (``reduce_bucket_size``).
        ns_steps: Newton-Schulz iterations, for the cost model.
        initial_load: NS cost each rank already owns in earlier sub-groups of the same process
            group (length ``world_size``), so that several sub-groups balance together; zeros
            when omitted.
        holders: per matrix, the ranks that hold a piece of it; its owner is one of them (the
            least loaded), so a matrix one rank holds whole never travels. ``None``: every rank
            holds a piece of every matrix (ZeRO-3).

    Returns:
        OwnerPlan: per bucket, the LPT bound ``max(bin) <= sum(bucket) / W + max(cost in bucket)``;
        over the plan, ``max(load) - min(load)`` is at most the largest spread
        ``max(bin) - min(bin)`` of any one bucket.

    Raises:
        ValueError: for ``world_size < 1``, an ``initial_load`` of the wrong length, or a matrix
            without holders.
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
        # LPT into W bins: balances the NS work of this bucket.
        bin_of, bin_load = {}, [0.0] * world_size
        for j in sorted(bucket, key=lambda j: (-costs[j], j)):
            b = min(range(world_size), key=lambda b: (bin_load[b], b))
            bin_of[j] = b
            bin_load[b] += costs[j]
        # Heaviest bin to the rank with the least work so far: balances the whole plan.
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
    """Elements of exchange buffer each rank reserves for ``plan``, in the pipeline's layout.

    A slot holds one bucket in flight: an outgoing buffer (the rank's pieces of the bucket's
    matrices) and an incoming one (every piece of the matrices it owns there). Each is sized to
    the largest bucket, and ``slots`` of them are kept.

    Args:
        plan: the owner plan.
        pieces: per matrix, its piece size on every rank (length ``world_size`` each).
        slots: buckets in flight at once (``slots_for_depth``).

    Returns:
        list of length ``world_size``: reserved elements per rank.
    """
    most_out, most_in = _largest_buffers(plan, pieces)
    busy = min(slots, max(1, len(plan.buckets)))
    return [busy * (a + b) for a, b in zip(most_out, most_in)]


def within_budget(plan: OwnerPlan,
                  pieces: Sequence[Sequence[int]],
                  slots: int,
                  result_itemsize: int = 4,
                  state_numels: Optional[Sequence[int]] = None) -> bool:
    """Whether every rank's reserved buffers (``reserved_numel``) and what it allocates as owner
    together fit the elements it holds (its momentum partition). Then Muon's state, buffers and
    owner working set take no more than the second moment Adam would keep, and Muon's peak in
    ``step()`` stays at Adam's.

    What an owner allocates: its Newton-Schulz working set (``OwnerPlan.workspace``) and, where
    the results are narrower than the fp32 exchange (``result_itemsize`` bytes: fp16 or bf16
    Newton-Schulz on an accelerator), the results of its largest bucket, which it holds until the
    bucket's calls are done (``pipeline``), counted in fp32 elements; and, for a Muon variant
    with owner state (``owner_state``), the fp32 state of the matrices it owns (``state_numels``:
    per matrix; ``None`` for plain Muon, which keeps none).
    """
    _, most_in = _largest_buffers(plan, pieces)
    held = [-(-n * result_itemsize // 4) if result_itemsize < 4 else 0 for n in most_in]
    state = [0] * plan.world_size
    for owner, n in zip(plan.owners, state_numels or ()):
        state[owner] += n
    budget = [sum(p[r] for p in pieces) - plan.workspace(r) - held[r] - state[r] for r in range(plan.world_size)]
    return all(n <= b for n, b in zip(reserved_numel(plan, pieces, slots), budget))


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
    """``plan_owners`` with the largest bucket size whose exchange buffers fit every rank's budget.

    The budget of rank ``r`` is the elements it holds (``sum(pieces[j][r])``, the size of its
    momentum partition) less its Newton-Schulz working set as owner (``within_budget``): then
    Muon's state and buffers together take no more memory than Adam's two moments would, and no
    more at the peak of the step. Bucket sizes tried: ``max_bucket_numel`` (``reduce_bucket_size``), then the
    sizes of the first k matrices together, by bisection (a fitting size; the largest one wherever
    the buffers grow monotonically with the bucket size, as they almost always do); where none fits (one matrix alone is
    larger than the budget allows), every matrix gets a bucket of its own.

    Args:
        specs, world_size, ns_steps, initial_load, holders: as for ``plan_owners``.
        pieces: per matrix, its piece size on every rank.
        max_bucket_numel: the largest bucket size to use (elements of whole matrices).
        slots: buckets in flight at once.
        result_itemsize: bytes per element of the Newton-Schulz results (``within_budget``).
        state_numels: per matrix, the owner state of a Muon variant (``within_budget``).

    Returns:
        OwnerPlan: deterministic in its inputs (every rank picks the same bucket size).

    Raises:
        ValueError: see ``plan_owners`` and ``make_buckets``.
    """

    def plan(bucket_numel):
        return plan_owners(specs, world_size, bucket_numel, ns_steps, initial_load, holders)

    def fits(candidate):
        return within_budget(candidate, pieces, slots, result_itemsize, state_numels)

    # Candidate sizes: the first k matrices' total for every k (each gives a different bucketing),
    # at most max_bucket_numel. The buffers grow with the bucket size but, with LPT owners, not
    # strictly monotonically: bisection returns a size that fits, not always the largest one.
    candidates, total = [], 0
    for spec in specs:
        total += spec.numel
        if total > max_bucket_numel:
            break
        candidates.append(total)
    if max_bucket_numel > total:
        whole = plan(max_bucket_numel)
        if fits(whole):
            return whole
    best = plan(1)  # every matrix alone: the least the pipeline can reserve
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
    """The owner plan and the pipeline depth whose exchange buffers fit every rank's momentum.

    ``owner_plan.plan_within_budget`` at ``depth``'s slots; where even one matrix per bucket does
    not fit (a matrix large against the rank's partition), the next lower depth, down to 1, where
    the buffers are one bucket's and may still exceed the budget.

    Args:
        specs, pieces, world_size, max_bucket_numel: as for ``plan_within_budget``.
        depth: the depth asked for (at least 1).
        plan_args: ``ns_steps``, ``initial_load``, ``holders``, ``result_itemsize``,
            ``state_numels`` of ``plan_within_budget``.

    Returns:
        ``(plan, depth)``.
    """
    for d in range(depth, 0, -1):
        plan = plan_within_budget(specs, pieces, world_size, max_bucket_numel, slots_for_depth(d), **plan_args)
        if within_budget(plan, pieces, slots_for_depth(d), plan_args.get("result_itemsize", 4),
                         plan_args.get("state_numels")):
            return plan, d
    return plan, 1
