"""Mutable free-resource state of an inventory, grouped by node signature for fast scoring.

Nodes whose free state is identical (same hardware class, same free CPU, memory and GPU shares)
share one *signature*; a policy scores a signature once and the result holds for every node in
the group. For nodes with one GPU model and no NVLink groups the GPUs are interchangeable, so the
signature lists free shares sorted, and ``order[i]`` maps canonical positions back to GPU indices.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .model import MILLI, Inventory, Request, share_taken

#: ``(class_id, cpu_free, mem_free, free milli per GPU in canonical order)``
Sig = tuple[int, int, int, tuple[int, ...]]
#: ``(cpu, mem, num_gpu, gpu_milli, allowed models, needs nvlink)``, see ``Request.shape``
Shape = tuple[int, int, int, int, frozenset[str], bool]


@dataclass(frozen=True)
class NodeClass:
    """Static hardware of a node: capacities, GPU models and NVLink groups (canonical order)."""

    cpu_milli: int
    memory_mib: int
    models: tuple[str, ...]
    nvlink: tuple[str | None, ...]
    interchangeable: bool
    #: per GPU: share step (see ``GPU.share_step_milli``) and capacity; None when every GPU is
    #: a plain 1000-milli GPU that takes any fraction (the common case, kept off the hot path)
    steps: tuple[int, ...] | None = None
    caps: tuple[int, ...] | None = None

    def take(self, p: int, milli: int) -> int:
        """What a fraction of ``milli`` takes on GPU position p; 0: it cannot go there."""
        if self.steps is None or self.caps is None:
            return milli
        return share_taken(milli, self.steps[p], self.caps[p])

    @property
    def num_gpus(self) -> int:
        return len(self.models)


class ClusterState:
    """Free CPU, memory and GPU milli per node, kept exact with integer arithmetic."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        nodes = inventory.nodes
        self.cpu_free: list[int] = [n.cpu_milli for n in nodes]
        self.mem_free: list[int] = [n.memory_mib for n in nodes]
        self.gpu_free: list[list[int]] = [[g.capacity_milli for g in n.gpus] for n in nodes]
        self.used_gpu_milli = 0
        #: bumped whenever resources are given back (a shape that failed since cannot fit yet)
        self.free_epoch = 0
        #: largest node CPU and GPU capacity, the scale best-fit normalises by
        self.max_cpu_milli = max((n.cpu_milli for n in nodes), default=0) or 1
        self.max_mem_mib = max((n.memory_mib for n in nodes), default=0) or 1
        self.max_gpu_milli = MILLI * max((len(n.gpus) for n in nodes), default=0) or MILLI
        self.classes: list[NodeClass] = []
        class_ids: dict[NodeClass, int] = {}
        self.class_of: list[int] = []
        self.uuid_loc: dict[str, tuple[int, int]] = {}
        for i, node in enumerate(nodes):
            models = tuple(g.model for g in node.gpus)
            links = tuple(g.nvlink_group for g in node.gpus)
            steps = tuple(g.share_step_milli for g in node.gpus)
            caps = tuple(g.capacity_milli for g in node.gpus)
            plain = all(s == 1 for s in steps) and all(c == MILLI for c in caps)
            inter = (
                len(set(models)) <= 1
                and len(set(links)) <= 1
                and len(set(steps)) <= 1
                and len(set(caps)) <= 1
            )
            cls = NodeClass(
                node.cpu_milli,
                node.memory_mib,
                models,
                links,
                inter,
                None if plain else steps,
                None if plain else caps,
            )
            if cls not in class_ids:
                class_ids[cls] = len(self.classes)
                self.classes.append(cls)
            self.class_of.append(class_ids[cls])
            for j, gpu in enumerate(node.gpus):
                self.uuid_loc[gpu.uuid] = (i, j)
        #: interned signatures: id -> signature (ids are stable until ``generation`` changes)
        self.sigs: list[Sig] = []
        self._sid: dict[Sig, int] = {}
        self.generation = 0
        self.node_sid: list[int] = []
        self.order: list[tuple[int, ...]] = []
        #: live signature id -> nodes in that state (insertion order: newest states last)
        self.groups: dict[int, set[int]] = {}
        #: GPU capability -> live signature ids (see ``cap_of``), to skip hopeless groups
        self.cap_index: dict[int, dict[int, None]] = {}
        #: GPU model -> capability -> number of live signatures (for quick explanations)
        self.model_caps: dict[str, dict[int, int]] = {}
        for i in range(len(nodes)):
            s, o = self._signature(i)
            sid = self._intern(s)
            self.node_sid.append(sid)
            self.order.append(o)
            self._join(i, sid)

    @staticmethod
    def cap_of(gpus: tuple[int, ...]) -> int:
        """``1000 + idle GPUs`` when some GPU is idle, else the largest free share (0..999)."""
        idle = sum(1 for f in gpus if f == MILLI)
        return MILLI + idle if idle else max(gpus, default=0)

    def _join(self, i: int, sid: int) -> None:
        members = self.groups.get(sid)
        if members is None:
            self.groups[sid] = {i}
            cap = self.cap_of(self.sigs[sid][3])
            self.cap_index.setdefault(cap, {})[sid] = None
            for model in set(self.classes[self.sigs[sid][0]].models):
                caps = self.model_caps.setdefault(model, {})
                caps[cap] = caps.get(cap, 0) + 1
        else:
            members.add(i)

    def _leave(self, i: int, sid: int) -> None:
        group = self.groups[sid]
        group.discard(i)
        if not group:
            del self.groups[sid]
            cap = self.cap_of(self.sigs[sid][3])
            bucket = self.cap_index[cap]
            del bucket[sid]
            if not bucket:
                del self.cap_index[cap]
            for model in set(self.classes[self.sigs[sid][0]].models):
                caps = self.model_caps[model]
                caps[cap] -= 1
                if not caps[cap]:
                    del caps[cap]

    def candidates(self, shape: Shape) -> list[int]:
        """Live signature ids whose GPUs could host ``shape`` (CPU, memory, models unchecked)."""
        if shape[2]:
            need = MILLI + shape[2]
        elif shape[3]:
            need = shape[3]
        else:
            return list(self.groups)
        out: list[int] = []
        for cap, sids in self.cap_index.items():
            if cap >= need:
                out.extend(sids)
        return out

    #: interned signatures are renumbered past this many (policies drop their caches then)
    intern_limit = 2_000_000

    def _intern(self, sig: Sig) -> int:
        sid = self._sid.get(sig)
        if sid is None:
            sid = len(self.sigs)
            self.sigs.append(sig)
            self._sid[sig] = sid
        return sid

    def _renumber(self) -> None:
        live = {sid: self.sigs[sid] for sid in self.groups}
        self.sigs = []
        self._sid = {}
        remap = {old: self._intern(sig) for old, sig in live.items()}
        self.groups = {remap[old]: members for old, members in self.groups.items()}
        self.cap_index = {
            cap: {remap[old]: None for old in sids} for cap, sids in self.cap_index.items()
        }
        self.node_sid = [remap[sid] for sid in self.node_sid]
        self.generation += 1

    def sig(self, i: int) -> Sig:
        """The current signature of node i."""
        return self.sigs[self.node_sid[i]]

    # -- signatures -------------------------------------------------------------------------

    def _signature(self, i: int) -> tuple[Sig, tuple[int, ...]]:
        return self.signature_of(i, self.cpu_free[i], self.mem_free[i], self.gpu_free[i])

    def signature_of(
        self, i: int, cpu_free: int, mem_free: int, free: list[int]
    ) -> tuple[Sig, tuple[int, ...]]:
        """Signature and canonical order node i would have with the given free resources."""
        cid = self.class_of[i]
        if self.classes[cid].interchangeable:
            order = tuple(sorted(range(len(free)), key=free.__getitem__))
            gpus = tuple(free[j] for j in order)
        else:
            order = tuple(range(len(free)))
            gpus = tuple(free)
        return (cid, cpu_free, mem_free, gpus), order

    def _refresh(self, i: int) -> None:
        if len(self.sigs) >= self.intern_limit:
            self._renumber()  # before leaving: every node must be in a live group here
        self._leave(i, self.node_sid[i])
        s, o = self._signature(i)
        sid = self._intern(s)
        self.node_sid[i] = sid
        self.order[i] = o
        self._join(i, sid)

    def node_class(self, sig: Sig) -> NodeClass:
        return self.classes[sig[0]]

    # -- mutation ---------------------------------------------------------------------------

    def can_apply(self, i: int, cpu: int, mem: int, shares: Iterator[tuple[int, int]]) -> bool:
        """Whether taking ``cpu``, ``mem`` and ``(gpu index, milli)`` shares on node i fits."""
        if cpu > self.cpu_free[i] or mem > self.mem_free[i]:
            return False
        need: dict[int, int] = {}
        for j, m in shares:
            need[j] = need.get(j, 0) + m
        free = self.gpu_free[i]
        return all(0 <= j < len(free) and m <= free[j] for j, m in need.items())

    def apply(self, i: int, cpu: int, mem: int, shares: list[tuple[int, int]], sign: int) -> None:
        """Take (sign=+1) or give back (sign=-1) resources on node i; never goes negative."""
        if sign > 0 and not self.can_apply(i, cpu, mem, iter(shares)):
            raise AssertionError(f"over-commit on node {self.inventory.nodes[i].name}")
        if sign < 0:
            self.free_epoch += 1
        self.cpu_free[i] -= sign * cpu
        self.mem_free[i] -= sign * mem
        free = self.gpu_free[i]
        for j, m in shares:
            free[j] -= sign * m
            self.used_gpu_milli += sign * m
        self._refresh(i)

    # -- fitting ----------------------------------------------------------------------------

    def options(self, sig: Sig, shape: Shape) -> list[tuple[int, ...]]:
        """Distinct GPU choices (canonical positions) for ``shape`` on a node in state ``sig``.

        Empty list: does not fit. ``[()]``: fits without GPUs. For interchangeable GPUs only one
        position per distinct free value is listed, since the others are equivalent.
        """
        _, cpu_free, mem_free, gpus = sig
        cpu, mem, num_gpu, milli, models, nvlink = shape
        if cpu > cpu_free or mem > mem_free:
            return []
        if not num_gpu and not milli:
            return [()]
        cls = self.classes[sig[0]]
        allowed = [not models or m in models for m in cls.models]
        if milli:
            out: list[tuple[int, ...]] = []
            seen: set[int] = set()
            if cls.steps is not None:
                # devices cut into slices: only the smallest that hold the share (a quarter
                # goes to a free 2g.20gb instance, never to a 3g.40gb one beside it)
                takes = [(cls.take(p, milli), p) for p, f in enumerate(gpus) if allowed[p]]
                fits = [(t, p) for t, p in takes if t and gpus[p] >= t]
                least = min((t for t, _ in fits), default=0)
                return [(p,) for t, p in fits if t == least]
            for p, f in enumerate(gpus):
                if f >= milli and allowed[p]:
                    if cls.interchangeable:
                        if f in seen:
                            continue
                        seen.add(f)
                    out.append((p,))
            return out
        idle = [p for p, f in enumerate(gpus) if f == MILLI and allowed[p]]
        if len(idle) < num_gpu:
            return []
        if cls.interchangeable:
            if nvlink and cls.nvlink[0] is None:
                return []
            return [tuple(idle[:num_gpu])]
        buckets: dict[tuple[str, str | None], list[int]] = {}
        for p in idle:
            if nvlink and cls.nvlink[p] is None:
                continue
            key = (cls.models[p], cls.nvlink[p] if nvlink else None)
            buckets.setdefault(key, []).append(p)
        outs = [tuple(ps[:num_gpu]) for ps in buckets.values() if len(ps) >= num_gpu]
        if nvlink:
            return outs
        return outs or [tuple(idle[:num_gpu])]

    def after(self, sig: Sig, shape: Shape, option: tuple[int, ...]) -> Sig:
        """The signature a node in state ``sig`` has after taking ``shape`` with ``option``."""
        cid, cpu_free, mem_free, gpus = sig
        cls = self.classes[cid]
        g = list(gpus)
        for p in option:
            g[p] -= MILLI if shape[2] else cls.take(p, shape[3])
        if cls.interchangeable:
            g.sort()
        return (cid, cpu_free - shape[0], mem_free - shape[1], tuple(g))

    def taken(self, sig: Sig, shape: Shape, option: tuple[int, ...]) -> int:
        """Milli each GPU of ``option`` gives up for ``shape`` (a share rounded to its step)."""
        if shape[2]:
            return MILLI
        return self.classes[sig[0]].take(option[0], shape[3]) if option else 0

    def fitting_positions(self, sig: Sig, shape: Shape) -> list[int]:
        """Every GPU position (duplicates included) a fractional ``shape`` fits on."""
        cls = self.classes[sig[0]]
        models = shape[4]
        fits = [
            (take, p)
            for p, f in enumerate(sig[3])
            if (take := cls.take(p, shape[3]))
            and f >= take
            and (not models or cls.models[p] in models)
        ]
        if cls.steps is not None and fits:  # only the smallest slices that hold it, as options()
            least = min(t for t, _ in fits)
            return [p for t, p in fits if t == least]
        return [p for _, p in fits]

    def shares_for(self, i: int, shape: Shape, option: tuple[int, ...]) -> list[tuple[int, int]]:
        """Translate canonical positions into ``(gpu index, milli)`` shares on node i."""
        order = self.order[i]
        if shape[2]:
            return [(order[p], MILLI) for p in option]
        cls = self.classes[self.class_of[i]]
        return [(order[p], cls.take(order[p], shape[3])) for p in option]

    def fits_request(self, request: Request) -> bool:
        """Whether any node could take ``request`` right now."""
        shape = request.shape
        return any(self.options(self.sigs[sid], shape) for sid in self.groups)
