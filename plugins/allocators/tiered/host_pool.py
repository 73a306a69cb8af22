"""The host tier's index: which host slot holds which cached page, in LRU order.

An entry is keyed exactly as the prefix allocator keys a cached page: its
chained hash, its token ids and the ``uid`` of the page before it. It keeps
the page's own ``uid`` too, so that a page loaded back to the device is
entered in the device cache under the same identity, and its children (on
either tier) still chain from it. A lookup compares tokens and parent, never
the hash alone, so a hash collision cannot serve another prefix's KV.

Slots under a copy (being written by a save, or read by a load) are *busy*:
they are neither evicted nor handed out until the copy is done.
"""

from __future__ import annotations

from collections import OrderedDict


class HostEntry:
    """One page's KV held in a host slot."""

    __slots__ = ("hash", "parent_uid", "slot", "token_ids", "uid")

    def __init__(
        self, slot: int, hash_: int, parent_uid: int, uid: int, token_ids: tuple[int, ...]
    ) -> None:
        self.slot = slot
        self.hash = hash_
        self.parent_uid = parent_uid
        self.uid = uid
        self.token_ids = token_ids


class HostPool:
    """``num_slots`` host pages: free slots, and entries in LRU order (oldest first)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[int, HostEntry] = OrderedDict()  # slot -> entry, oldest first
        self._by_hash: dict[int, list[HostEntry]] = {}
        self._by_uid: dict[int, HostEntry] = {}
        self.busy: dict[int, int] = {}  # slot -> copies in flight that touch it

    def __len__(self) -> int:
        return len(self._lru)

    def find(self, hash_: int, parent_uid: int, token_ids: tuple[int, ...]) -> HostEntry | None:
        """The entry of this exact page, or None."""
        for entry in self._by_hash.get(hash_, ()):
            if entry.parent_uid == parent_uid and entry.token_ids == token_ids:
                return entry
        return None

    def holds_uid(self, uid: int) -> bool:
        """Whether the page whose device cache entry had ``uid`` has a copy here."""
        return uid in self._by_uid

    def touch(self, entry: HostEntry) -> None:
        """Make ``entry`` the most recently used."""
        self._lru.move_to_end(entry.slot)

    def take_slot(self) -> int | None:
        """A slot to write a new page into: a free one, else the least recently used entry's
        that no copy touches (that entry is dropped); None when every slot is busy."""
        if self._free:
            return self._free.pop()
        for slot in self._lru:
            if not self.busy.get(slot):
                self._drop(slot)
                return slot
        return None

    def give_back(self, slot: int) -> None:
        """Return a slot taken with :meth:`take_slot` and never entered."""
        self._free.append(slot)

    def enter(
        self, slot: int, hash_: int, parent_uid: int, uid: int, token_ids: tuple[int, ...]
    ) -> HostEntry:
        """Record that ``slot`` holds this page (most recently used)."""
        entry = HostEntry(slot, hash_, parent_uid, uid, token_ids)
        self._lru[slot] = entry
        self._by_hash.setdefault(hash_, []).append(entry)
        self._by_uid[uid] = entry
        return entry

    def _drop(self, slot: int) -> None:
        entry = self._lru.pop(slot)
        bucket = self._by_hash[entry.hash]
        bucket.remove(entry)
        if not bucket:
            del self._by_hash[entry.hash]
        if self._by_uid.get(entry.uid) is entry:
            del self._by_uid[entry.uid]

    def mark_busy(self, slots: list[int]) -> None:
        """A copy touching ``slots`` started."""
        for slot in slots:
            self.busy[slot] = self.busy.get(slot, 0) + 1

    def mark_idle(self, slots: list[int]) -> None:
        """A copy touching ``slots`` ended."""
        for slot in slots:
            left = self.busy[slot] - 1
            if left:
                self.busy[slot] = left
            else:
                del self.busy[slot]

    def entries(self) -> list[HostEntry]:
        """Every entry, least recently used first."""
        return list(self._lru.values())

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)
