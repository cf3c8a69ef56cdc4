"""KV tiers below the device: full blocks that leave the prefix cache are kept in host memory and on disk, and loaded
back instead of recomputed (``kv_offload`` in the engine config; page format and sharing: docs/engine.md).

A tier is a folder of pages, one per block, named by the block's chained hash under ``tier_fingerprint`` (model, KV
layout, weights; at tensor_parallel_size N also the rank's heads: each rank pages its own, engine.rank_tiers). The
host tier is shared memory, one pool per node, model and ``host_pool``; the disk tier outlives the worker. Each is
bounded, evicts its least recently used pages into the tier below, and turns itself off (serving goes on) when its
folder cannot be written. Down: the engine gathers the evicted blocks' KV in one copy (``save``); the saver thread
writes the pages. Up: a prompt whose prefix continues in a tier waits in LOADING while the loader thread reads and
checks its pages (``start_load``); the engine writes them into its blocks at a later step (``poll``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch
import xxhash

from engine.block_manager import HashEvents, KvEventBatch
from engine.blocks import prompt_block_hashes
from engine.config import KV_TIERS, KVOffloadConfig, TierName
from engine.kv_cache import KVCache, KVSpec

if TYPE_CHECKING:
    from engine.request import Request
    from engine.tensor_parallel import HeadSplit

logger = logging.getLogger(__name__)

PAGE_MAGIC = b"PDKV"
PAGE_VERSION = 1
# magic, version, spare, fingerprint (16 bytes), block hash, tokens in the block, spare, payload bytes, checksum
PAGE_HEADER = struct.Struct("<4sHH16sQIIQQ")
PAGE_SUFFIX = ".kv"
STALE_TEMP_S = 60.0  # a temporary page this old belongs to a writer that died
LOW_WATER = 0.9  # an over-full tier evicts down to this fraction of its bound
RESCAN_EVERY_WRITES = 64  # a shared tier re-reads its true size this often (other workers write there too)
SAMPLES_PER_TENSOR = 4096  # weight values per tensor that go into the fingerprint
MIB = 1024 * 1024


def tier_fingerprint(spec: KVSpec, model: torch.nn.Module, split: HeadSplit | None = None) -> bytes:
    """16 bytes naming what a page's bytes mean: the KV layout (``KVSpec``) and the weights, by an evenly strided
    sample of every tensor (a fine-tune of the same architecture gets other pages; reading all weights would cost
    seconds at start-up); at a degree above 1, which of the model's heads the rank holds (``split``), so that no
    two ranks, nor two degrees, read each other's pages."""
    digest = xxhash.xxh3_128()
    digest.update(repr(dataclasses.astuple(spec)).encode())
    if split is not None and split.size > 1:
        digest.update(repr(("heads", split.rank, split.size, split.kv_start, split.kv_heads, split.kv_total)).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // SAMPLES_PER_TENSOR)
            sample = flat[::step][:SAMPLES_PER_TENSOR].to("cpu", torch.float32).contiguous()
            digest.update(name.encode() + str(tuple(tensor.shape)).encode())
            digest.update(sample.numpy().tobytes())
    return digest.digest()


class PageError(ValueError):
    """A page that must not be used (the message says why); it is deleted and its prefix recomputed."""


def encode_header(fingerprint: bytes, block_hash: int, token_ids: tuple[int, ...], payload: memoryview) -> bytes:
    """Header and token ids of one page; the payload follows them in the file."""
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    checksum = xxhash.xxh3_64(tokens)
    checksum.update(payload)
    header = PAGE_HEADER.pack(
        PAGE_MAGIC, PAGE_VERSION, 0, fingerprint, block_hash, len(token_ids), 0, len(payload), checksum.intdigest()
    )
    return header + tokens


def decode_page(
    data: bytearray | memoryview, fingerprint: bytes, block_hash: int, token_ids: tuple[int, ...], page_bytes: int
) -> memoryview:
    """The payload of a page read whole, or PageError naming what does not match."""
    if len(data) < PAGE_HEADER.size:
        raise PageError(f"truncated page ({len(data)} bytes)")
    magic, version, _, page_fp, page_hash, num_tokens, _, payload_len, checksum = PAGE_HEADER.unpack_from(data)
    if magic != PAGE_MAGIC or version != PAGE_VERSION:
        raise PageError(f"not a version-{PAGE_VERSION} KV page")
    if page_fp != fingerprint:
        raise PageError("page of another model or KV layout")
    if page_hash != block_hash or num_tokens != len(token_ids):
        raise PageError("page of another block")
    tokens_end = PAGE_HEADER.size + 8 * num_tokens
    if payload_len != page_bytes or len(data) != tokens_end + payload_len:
        raise PageError(f"page of {len(data)} bytes, expected {tokens_end + page_bytes}")
    view = memoryview(data)
    if struct.unpack_from(f"<{num_tokens}q", data, PAGE_HEADER.size) != token_ids:
        raise PageError("page of other tokens (hash collision)")
    digest = xxhash.xxh3_64(view[PAGE_HEADER.size : tokens_end])
    digest.update(view[tokens_end:])
    if digest.intdigest() != checksum:
        raise PageError("checksum mismatch")
    return view[tokens_end:]


def _live_holders(folder: Path) -> list[Path]:
    """The holder files of a shared folder whose process still runs (the others are swept)."""
    live = []
    for holder in (folder / ".holders").iterdir():
        try:
            alive = _pid_alive(int(holder.name.split("-")[0]))
        except ValueError:
            alive = False
        if alive:
            live.append(holder)
        else:
            holder.unlink(missing_ok=True)
    return live


def sweep_dead_pools(base: Path, keep: Path) -> None:
    """Remove the host pools under ``base`` (``<pool>/<fingerprint>``) that no live process holds and nobody has
    touched for a while: what workers killed outright left in shared memory. ``keep`` (ours) keeps its pages."""
    now = time.time()
    for pool in list(base.iterdir()) if base.is_dir() else []:
        for folder in list(pool.iterdir()) if pool.is_dir() else []:
            try:
                if folder == keep or now - folder.stat().st_mtime < STALE_TEMP_S or _live_holders(folder):
                    continue
            except OSError:
                continue  # removed meanwhile, or not one of ours
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            pool.rmdir()  # once empty


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PageStore:
    """One tier: a folder of pages, bounded by ``capacity_bytes``, evicting the least recently used into
    ``evict_to`` (the tier below, or None: dropped). Used by the engine's thread (lookups) and the tier threads."""

    def __init__(
        self,
        name: TierName,
        folder: Path,
        capacity_bytes: int,
        fingerprint: bytes,
        page_bytes: int,
        block_size: int,
        evict_to: PageStore | None = None,
        shared: bool = False,
    ) -> None:
        self.name = name
        self.folder = folder
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.page_bytes = page_bytes
        self.block_size = block_size
        self.evict_to = evict_to
        self.shared = shared  # other workers write here too: the true size is re-read now and then
        self.events = HashEvents()
        self.disabled = ""  # why this tier turned itself off ("" while on)
        self.written_bytes = 0  # pages written here since start: saved from the device or evicted from above
        self._used_bytes = 0
        self._writes_since_scan = 0
        self._holder: Path | None = None
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if shared:
                holders = folder / ".holders"
                holders.mkdir(mode=0o700, exist_ok=True)
                self._holder = holders / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
                self._holder.touch()
                sweep_dead_pools(folder.parent.parent, keep=folder)
            self._scan()
        except OSError as exc:
            self._disable(f"cannot use {folder}: {exc}")

    def _disable(self, reason: str) -> None:
        if not self.disabled:
            self.disabled = reason
            logger.error("KV %s tier turned off (serving goes on without it): %s", self.name, reason)

    def path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:016x}{PAGE_SUFFIX}"

    def contains(self, block_hash: int) -> bool:
        return not self.disabled and self.path(block_hash).exists()

    def touch(self, block_hash: int) -> None:
        """Mark a page recently used (least recently used pages go first)."""
        with contextlib.suppress(OSError):  # evicted meanwhile
            os.utime(self.path(block_hash))

    def snapshot(self) -> list[int]:
        """Every hash this tier holds now (its KV events' reset), others' pages in a shared tier included."""
        if self.disabled:
            return []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        hashes = []
        for name in names:
            if name.endswith(PAGE_SUFFIX):
                try:
                    hashes.append(int(name[: -len(PAGE_SUFFIX)], 16))
                except ValueError:
                    continue
        return hashes

    # ---- writing (the saver thread) ------------------------------------------------------------------------------

    def write(self, block_hash: int, token_ids: tuple[int, ...], payload: memoryview) -> int:
        """Store one page (written whole, then renamed into place); returns the bytes written (0: not written)."""
        if self.disabled or self.contains(block_hash):
            return 0
        header = encode_header(self.fingerprint, block_hash, token_ids, payload)
        return self._place(block_hash, lambda f: (f.write(header), f.write(payload)))

    def adopt(self, source: Path, block_hash: int) -> int:
        """Take a page evicted from the tier above (same fingerprint, already whole); returns the bytes written."""
        if self.disabled or self.contains(block_hash):
            return 0
        try:
            with open(source, "rb") as src:
                return self._place(block_hash, lambda f: shutil.copyfileobj(src, f))
        except OSError:  # the page went meanwhile (another worker evicted it)
            return 0

    def _place(self, block_hash: int, fill: Callable[[BinaryIO], object]) -> int:
        temp = self.folder / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                fill(f)
                size = f.tell()
            os.replace(temp, self.path(block_hash))  # visible only now, whole
        except OSError as exc:
            with contextlib.suppress(OSError):  # the folder itself may be what failed
                temp.unlink()
            self._disable(f"writing a page failed: {exc}")
            return 0
        self.events.stored(block_hash)
        self.written_bytes += size
        self._used_bytes += size
        self._writes_since_scan += 1
        if self._used_bytes > self.capacity_bytes or (self.shared and self._writes_since_scan >= RESCAN_EVERY_WRITES):
            self.evict_over_bound()
        return size

    def evict_over_bound(self) -> None:
        """Move the least recently used pages to the tier below until this one is under its low-water mark."""
        pages = self._scan()
        if self._used_bytes <= self.capacity_bytes:
            return
        target = int(self.capacity_bytes * LOW_WATER)
        for _mtime, size, path in sorted(pages):
            if self._used_bytes <= target:
                break
            block_hash = int(path.name[: -len(PAGE_SUFFIX)], 16)
            if self.evict_to is not None:
                self.evict_to.adopt(path, block_hash)
            path.unlink(missing_ok=True)
            self.events.removed(block_hash)
            self._used_bytes -= size

    def _scan(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every page; sets the true size and sweeps dead writers' temporary files."""
        pages = []
        now = time.time()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                try:
                    stat = entry.stat()
                except OSError:
                    continue  # evicted meanwhile
                if entry.name.endswith(PAGE_SUFFIX):
                    pages.append((stat.st_mtime, stat.st_size, Path(entry.path)))
                elif entry.name.startswith(".tmp-") and now - stat.st_mtime > STALE_TEMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        self._used_bytes = sum(size for _, size, _ in pages)
        self._writes_since_scan = 0
        return pages

    # ---- reading (the loader thread) -----------------------------------------------------------------------------

    @property
    def page_file_bytes(self) -> int:
        """A whole page file: header, token ids, payload."""
        return PAGE_HEADER.size + 8 * self.block_size + self.page_bytes

    def read(self, block_hash: int, token_ids: tuple[int, ...], into: memoryview) -> bool:
        """Read one page whole into ``into`` (``page_file_bytes`` long) and check it; False when it is gone or
        unusable (then it is deleted)."""
        if self.disabled:
            return False
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:  # an open page outlives its eviction by another worker
                size = f.readinto(into)
                extra = f.read(1)
            self.touch(block_hash)
        except OSError:
            return False
        try:
            if size != len(into) or extra:
                raise PageError(f"page of {size + len(extra)}+ bytes, expected {len(into)}")
            decode_page(into, self.fingerprint, block_hash, token_ids, self.page_bytes)
            return True
        except PageError as exc:
            logger.warning("KV %s tier page %s is unusable (%s): deleted, its prefix recomputed", self.name, path, exc)
            path.unlink(missing_ok=True)
            self.events.removed(block_hash)
            return False

    def close(self) -> None:
        """Leave the folder; the last live worker of a shared pool removes it (host memory is not left behind)."""
        if self._holder is None:
            return
        self._holder.unlink(missing_ok=True)
        self._holder = None
        try:
            live = _live_holders(self.folder)
        except OSError:
            return
        if not live:
            shutil.rmtree(self.folder, ignore_errors=True)
            for parent in (self.folder.parent, self.folder.parent.parent):  # the pool's and the user's, once empty
                try:
                    parent.rmdir()
                except OSError:
                    break


@dataclass(slots=True)
class TierLoad:
    """A request's prefix blocks being loaded back: blocks ``first_block`` on of its table, ``hashes`` in order."""

    request_id: str
    first_block: int
    block_ids: list[int]
    hashes: list[int]
    token_ids: list[tuple[int, ...]]
    counts_as_cached: bool  # the request's first admission: the loaded tokens count in its cached tokens
    started_s: float = field(default_factory=time.monotonic)
    # one row per block, each a whole page file as read (pinned on a GPU host); ``tiers``: where each read row came
    # from, in order (it ends where a page was missing or bad)
    buffer: torch.Tensor | None = None
    tiers: list[TierName] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    load_id: int = 0  # tensor parallel: how rank 0 names the load to the other ranks (engine.rank_tiers)


@dataclass(slots=True)
class TierStats:
    """Totals since start, per tier: prompt tokens loaded instead of computed, bytes copied down and back up."""

    hit_tokens: dict[TierName, int] = field(default_factory=lambda: dict.fromkeys(KV_TIERS, 0))
    saved_bytes: dict[TierName, int] = field(default_factory=lambda: dict.fromkeys(KV_TIERS, 0))  # pages written
    loaded_bytes: dict[TierName, int] = field(default_factory=lambda: dict.fromkeys(KV_TIERS, 0))
    loads: int = 0
    load_seconds: float = 0.0


def host_pool_folder(pool: str, fingerprint: bytes) -> Path:
    """The node's shared host tier of one model: shared memory where the system has it."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"pdserve-kv-{os.getuid()}" / pool / fingerprint.hex()


class KVTiers:
    """The engine's tiers (host above disk, each optional), their two threads and their figures."""

    def __init__(self, config: KVOffloadConfig, kv_cache: KVCache, fingerprint: bytes) -> None:
        self.kv_cache = kv_cache
        spec = kv_cache.spec
        self.block_size = spec.block_size
        self.page_bytes = spec.bytes_per_block
        self._stats = TierStats()
        self.stores: dict[TierName, PageStore] = {}
        below: PageStore | None = None
        layout = (fingerprint, self.page_bytes, self.block_size)
        if config.disk_dir is not None:
            below = PageStore("disk", Path(config.disk_dir) / fingerprint.hex(), config.disk_mb * MIB, *layout)
            self.stores["disk"] = below
        if config.host_memory_mb:
            folder = host_pool_folder(config.host_pool, fingerprint)
            host = PageStore("host", folder, config.host_memory_mb * MIB, *layout, evict_to=below, shared=True)
            self.stores = {"host": host, **self.stores}
        self.top = next(iter(self.stores.values()))
        self._saves: queue.Queue[tuple[torch.Tensor, list[tuple[int, tuple[int, ...]]], object] | None] = queue.Queue()
        self._loads: queue.Queue[TierLoad | None] = queue.Queue()
        self._pending: dict[str, TierLoad] = {}  # request id -> its load in flight
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: device-to-host copies of evicted blocks
        self.inline_io = config.inline_io
        self._saver = threading.Thread(target=self._save_loop, name="kv-tier-saver", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True)
        if not self.inline_io:
            self._saver.start()
            self._loader.start()

    # ---- down: blocks leaving the prefix cache -------------------------------------------------------------------

    def save(self, evicted: list[tuple[int, tuple[int, ...], int]]) -> None:
        """Copy evicted blocks' KV (hash, tokens, block id) out of the cache now, in one gather, before a forward or
        a transfer overwrites them; the saver thread writes the pages. Blocks a tier holds already are skipped."""
        wanted = []
        for block_hash, tokens, block_id in evicted:
            held = next((store for store in self.stores.values() if store.contains(block_hash)), None)
            if held is None:
                wanted.append((block_hash, tokens, block_id))
            else:
                held.touch(block_hash)  # just used on the device: the last to go down there
        if not wanted or self.top.disabled:
            return
        index = self.kv_cache.block_index([b for _, _, b in wanted])
        # [blocks, layers, 2, block_size, heads, dim]: each block's page one contiguous run
        gathered = torch.stack([kv.index_select(1, index) for kv in self.kv_cache.kv], dim=0).permute(2, 0, 1, 3, 4, 5)
        ready: object = None
        if gathered.is_cuda:  # copy on a side stream into pinned memory; the saver waits for its event
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(gathered.device)
            stream = self._copy_stream
            stream.wait_stream(torch.cuda.current_stream(gathered.device))
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(gathered, non_blocking=True)
                gathered.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
            gathered, ready = host, event
        else:
            gathered = gathered.contiguous()
        job = (gathered, [(h, tokens) for h, tokens, _ in wanted], ready)
        if self.inline_io:
            self._write_pages(*job)
        else:
            self._saves.put(job)

    def _save_loop(self) -> None:
        while (job := self._saves.get()) is not None:
            self._write_pages(*job)
            self._saves.task_done()

    def _write_pages(self, gathered: torch.Tensor, blocks: list[tuple[int, tuple[int, ...]]], ready: object) -> None:
        if ready is not None:
            ready.synchronize()  # type: ignore[attr-defined]
        raw = gathered.view(torch.uint8).reshape(len(blocks), -1).numpy()
        for i, (block_hash, tokens) in enumerate(blocks):
            try:
                self.top.write(block_hash, tokens, memoryview(raw[i]))
            except Exception:  # noqa: BLE001 - a tier fault must never end the engine's thread
                logger.exception("KV %s tier: saving a page failed", self.top.name)

    # ---- up: a prefix found in a tier ----------------------------------------------------------------------------

    def lookup(self, token_ids: list[int], first_block: int, max_blocks: int) -> list[int]:
        """The chained hashes of the blocks from ``first_block`` on that continue the prompt's prefix in some tier
        (at most ``max_blocks``; ``start_load`` takes them); a page found here may still fail its check when loaded
        (then less is loaded)."""
        if max_blocks <= 0:
            return []
        hashes = prompt_block_hashes(token_ids[: (first_block + max_blocks) * self.block_size], self.block_size)
        found: list[int] = []
        for block_hash in hashes[first_block:]:
            if not any(store.contains(block_hash) for store in self.stores.values()):
                break
            found.append(block_hash)
        return found

    def start_load(
        self, request: Request, token_ids: list[int], first_block: int, hashes: list[int], counts_as_cached: bool
    ) -> TierLoad:
        """Queue the reading of the tier blocks of ``token_ids`` (the request's) from block ``first_block`` on that
        ``lookup`` found (``hashes``), into the request's blocks there."""
        bs, num_blocks = self.block_size, len(hashes)
        tokens = token_ids[: (first_block + num_blocks) * bs]
        load = TierLoad(
            request.request_id,
            first_block,
            request.block_ids[first_block : first_block + num_blocks],
            hashes,
            [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(first_block, first_block + num_blocks)],
            counts_as_cached,
        )
        self._pending[request.request_id] = load
        self.read_async(load)
        return load

    def read_async(self, load: TierLoad) -> None:
        """Queue the reading of a load's pages on the loader thread (``load.done`` is set when it ends); inline, read
        them now."""
        if self.inline_io:
            self._read_pages(load)
        else:
            self._loads.put(load)

    def _load_loop(self) -> None:
        while (load := self._loads.get()) is not None:
            self._read_pages(load)

    def _read_pages(self, load: TierLoad) -> None:
        try:
            self._read(load)
        except Exception:  # noqa: BLE001 - what was read stays usable; the rest is computed
            logger.exception("KV tier: loading request %s's pages failed", load.request_id)
        load.done.set()

    def _read(self, load: TierLoad) -> None:
        """Each page straight into its row of the load's buffer, in chain order, up to the first one missing."""
        file_bytes = self.top.page_file_bytes
        pinned = self.kv_cache.kv[0].is_cuda
        load.buffer = torch.empty((len(load.hashes), file_bytes), dtype=torch.uint8, pin_memory=pinned)
        rows = load.buffer.numpy()
        for row, (block_hash, tokens) in zip(rows, zip(load.hashes, load.token_ids)):
            into = memoryview(row)
            store = next(
                (s for s in self.stores.values() if s.contains(block_hash) and s.read(block_hash, tokens, into)), None
            )
            if store is None:
                return  # the prefix ends here: the rest is computed
            load.tiers.append(store.name)

    def poll(self) -> list[TierLoad]:
        """Loads whose reading ended, their pages written into their blocks now (the engine's thread, between
        steps). The caller checks that each request still waits for it (an aborted one's blocks may be reused:
        ``write``)."""
        done = [load for load in self._pending.values() if load.done.is_set()]
        for load in done:
            del self._pending[load.request_id]
        return done

    def write(self, load: TierLoad) -> int:
        """Put a finished load's pages into its blocks (one copy per layer, from the rows as read); returns how many
        blocks were loaded."""
        count = len(load.tiers)
        if not count or load.buffer is None:
            return 0
        spec = self.kv_cache.spec
        payload_at = PAGE_HEADER.size + 8 * self.block_size  # a multiple of 8: the payload views as any dtype
        rows = load.buffer[:count, payload_at:]
        device = self.kv_cache.kv[0].device
        if device.type == "cuda":
            rows = rows.to(device, non_blocking=True)
        shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        pages = rows.view(spec.dtype).unflatten(1, shape)
        index = self.kv_cache.block_index(load.block_ids[:count])
        for layer, kv in enumerate(self.kv_cache.kv):
            kv.index_copy_(1, index, pages[:, layer].transpose(0, 1))
        load.buffer = None
        stats = self._stats
        for tier in load.tiers:
            stats.hit_tokens[tier] += self.block_size
            stats.loaded_bytes[tier] += self.page_bytes
        stats.loads += 1
        stats.load_seconds += time.monotonic() - load.started_s
        return count

    def drop(self, load: TierLoad) -> None:
        """A finished load whose request no longer waits for it: its pages go nowhere."""
        load.buffer = None

    @property
    def stats(self) -> TierStats:
        """A copy of the figures, with the bytes each tier's pages took as written by its store."""
        stats = self._stats
        saved = {name: store.written_bytes for name, store in self.stores.items()}
        return dataclasses.replace(
            stats,
            hit_tokens=dict(stats.hit_tokens),
            saved_bytes={tier: saved.get(tier, 0) for tier in KV_TIERS},
            loaded_bytes=dict(stats.loaded_bytes),
        )

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout_s: float) -> None:
        """Block until some load is read, at most ``timeout_s`` (an engine with nothing else to run)."""
        for load in list(self._pending.values()):
            if load.done.wait(timeout_s):
                return

    def cancel(self, request_id: str) -> None:
        """Forget a request's load (aborted): its pages, when read, go nowhere."""
        self._pending.pop(request_id, None)

    # ---- what the routers learn ----------------------------------------------------------------------------------

    def drain_events(self) -> Iterable[tuple[TierName, KvEventBatch]]:
        """Each tier's changes since the last drain, as (tier, batch)."""
        for name, store in self.stores.items():
            batch = store.events.drain(store.snapshot)
            if batch is not None:
                yield name, batch

    def resync_events(self) -> None:
        for store in self.stores.values():
            store.events.resync()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued saves (bounded), stop the threads, and leave the shared host pool."""
        if not self.inline_io:
            self._saves.put(None)
            self._loads.put(None)
            self._saver.join(timeout_s)
            self._loader.join(timeout_s)
        for store in self.stores.values():
            store.close()
