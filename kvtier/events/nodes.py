"""``NodeHashes``: the page hashes of tree nodes as the event hooks need them, cheaply.

A hook must capture a node's pages when it is called (the scheduler goes on changing the tree),
but hashing them there is most of a hook's cost. So a hook takes a node's hashes from
``node.page_hashes`` where the tree or the L3 tier already has them, and otherwise a ``Lazy``
that the publisher thread computes when it resolves the step (``write_back`` later stores the
result in the node, for the tree, L3 and later hooks). A node's key and hash list are replaced
on a split, never changed in place, so what a hook captured stays valid.

A node's pages in a range are captured as *chunks*, one per node, top-down::

    (hashes, first page, hash before the node, node key, namespace)

``hashes`` is a list of hex hashes or a ``Lazy``; the hash before the node is hex, a ``Lazy``
(the parent's, whose last page it is) or None under the root. Nothing is per page here.
"""

from __future__ import annotations

from kvtier.events.keys import KeySeed, chain_hashes

__all__ = ["Lazy", "NodeHashes", "chunk_hashes"]

MAX_LAZY = 4096  # nodes whose hashes wait for the publisher thread (beyond: hashed at once)


class Lazy:
    """The page hashes of one node's key, computed when first needed: on the publisher thread
    as it resolves a step's records, or on the scheduler thread if a hook needs them sooner.
    ``prev`` is the hash before the key (hex), or the parent's ``Lazy``; ``node`` the node
    whose key it is (for the write-back). Both threads may compute it at once: they get equal
    lists, and either is right."""

    __slots__ = ("hashes", "key", "node", "ns", "prev", "seed")

    def __init__(self, node, prev: str | Lazy, seed: KeySeed) -> None:
        self.node, self.key, self.ns, self.prev, self.seed = (
            node,
            node.key,
            node.namespace,
            prev,
            seed,
        )
        self.hashes: list[str] | None = None

    def get(self) -> list[str]:
        hashes = self.hashes
        if hashes is None:
            prev = self.prev
            if prev.__class__ is Lazy:
                prev = prev.get()[-1]
            hashes = self.hashes = chain_hashes(self.key, self.seed.namespace(self.ns), prev)
        return hashes


def chunk_hashes(chunk: tuple) -> tuple:
    """``chunk`` with its ``Lazy`` parts computed (what the mirror keeps)."""
    hashes, first, up, key, ns = chunk
    if hashes.__class__ is not Lazy and up.__class__ is not Lazy:
        return chunk
    if hashes.__class__ is Lazy:
        hashes = hashes.get()
    if up.__class__ is Lazy:
        up = up.get()[-1]
    return (hashes, first, up, key, ns)


class NodeHashes:
    """Page hashes of nodes for the hooks (scheduler thread): known, deferred, or computed.

    Args:
        seed: the page-key seed; ``rekey`` replaces it.
    """

    def __init__(self, seed: KeySeed) -> None:
        self.seed = seed
        self.P = seed.page_size
        self._digests = seed.digests  # request namespace -> the chain's seed (hex)
        # id(node) -> its Lazy: owed hashes. The Lazy keeps its node alive, so no other node
        # has that id while the entry is here; a key replaced by a split makes it stale.
        self.lazy: dict[int, Lazy] = {}

    def rekey(self, seed: KeySeed) -> None:
        """Hashes owed are under the old seed: none may go into a node now (the L3 tier
        re-hashes the nodes under the new one); records already taken keep theirs."""
        self.lazy.clear()
        self.seed = seed
        self._digests = seed.digests

    def of(self, node) -> list[str] | Lazy:
        """``node``'s page hashes if known, else a ``Lazy``. Hashed now only where the chain
        before the node is not known either (or the thread is far behind)."""
        hashes = node.page_hashes
        if hashes is not None:
            return hashes
        key = node.key
        lazy = self.lazy
        lz = lazy.get(id(node))
        if lz is not None and lz.key is key:
            return lz if lz.hashes is None else lz.hashes
        parent = node.parent
        if parent is None or len(key) < self.P:
            return self.hashes(node)
        if parent.parent is None:
            prev = self.seed.digest_hex(node.namespace)
        elif parent.page_hashes:
            prev = parent.page_hashes[-1]
        else:
            up = lazy.get(id(parent))
            if up is None or up.key is not parent.key:
                return self.hashes(node)
            prev = up if up.hashes is None else up.hashes[-1]
        if len(lazy) >= MAX_LAZY:
            return self.hashes(node)
        lz = lazy[id(node)] = Lazy(node, prev, self.seed)
        return lz

    def write_back(self) -> None:
        """Store the hashes the publisher thread has computed in their nodes (if still the
        same key: a node split since has other lists), for the tree, L3 and later hooks."""
        for lz in list(self.lazy.values()):  # a few a step: those of the last steps
            if lz.hashes is not None:
                self.settle(lz)

    def settle(self, lz: Lazy) -> None:
        """Store the computed hashes of ``lz`` in its node now (see ``write_back``)."""
        node = lz.node
        if node.page_hashes is None and node.key is lz.key and lz.seed is self.seed:
            node.page_hashes = lz.hashes
        if self.lazy.get(id(node)) is lz:
            del self.lazy[id(node)]

    def hashes(self, node) -> list[str]:
        """``node``'s page hashes, filling in those of it and its ancestors that lack them (the
        same chain and field as the L3 tier's ``node_hashes``)."""
        if node.page_hashes is not None:
            return node.page_hashes
        path, x = [], node
        while x.parent is not None and x.page_hashes is None:
            lz = self.lazy.pop(id(x), None)
            if lz is not None and lz.key is x.key:
                x.page_hashes = lz.get()  # the same list the thread uses (or will)
                break
            path.append(x)
            x = x.parent
        prev = x.page_hashes[-1] if x.parent is not None and x.page_hashes else None
        seed = self.seed
        for y in reversed(path):
            # Seeding the chain with the cached digest (what page_hashes does with no prev)
            # saves hashing the namespace again for every node under the root.
            start = prev if prev is not None else seed.digest_hex(y.namespace)
            y.page_hashes = chain_hashes(y.key, seed.namespace(y.namespace), start)
            prev = y.page_hashes[-1] if y.page_hashes else prev
        return node.page_hashes

    def leaf(self, node) -> tuple:
        """The chunk of all of ``node``'s pages (a new leaf, an unevicted node): ``chunks``
        for one node, without the walk, and with ``of``'s common case (a new leaf whose parent's
        last hash is known) inline: this runs once per insert on the scheduler thread."""
        parent, key, ns = node.parent, node.key, node.namespace
        if parent.parent is None:
            up = None
            prev = self._digests.get(ns) or self.seed.digest_hex(ns)
        else:
            up = parent.page_hashes
            up = self.of(parent) if up is None else up
            if up.__class__ is not Lazy:
                up = up[-1]
            prev = up
        hashes = node.page_hashes
        if hashes is None:
            lazy = self.lazy
            lz = lazy.get(id(node))
            if lz is not None and lz.key is key:
                hashes = lz if lz.hashes is None else lz.hashes
            elif len(key) < self.P or len(lazy) >= MAX_LAZY:
                hashes = self.hashes(node)
            else:
                hashes = lazy[id(node)] = Lazy(node, prev, self.seed)
        return (hashes, 0, up, key, ns)

    def chunks(self, node, start: int) -> list[tuple]:
        """The pages in ``[start, node.end)`` as one chunk per node, top-down (walking up from
        ``node`` through as many ancestors as the range covers)."""
        P = self.P
        chunks = []
        x = node
        while x.parent is not None and x.end > start:
            parent = x.parent
            up = None
            if parent.parent is not None:
                up = self.of(parent)
                if up.__class__ is not Lazy:
                    up = up[-1]
            key = x.key
            first = start - (x.end - len(key))  # x.start, a property: computed once here
            chunks.append((self.of(x), first // P if first > 0 else 0, up, key, x.namespace))
            x = parent
        chunks.reverse()
        return chunks
