"""Type stubs of the native module ``tierstore._core`` (the Rust binding)."""

from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, final

__all__ = [
    "CODEC_ENTRY",
    "CODEC_HEADER",
    "Buffer",
    "Container",
    "DeviceTurns",
    "Engine",
    "Gate",
    "PendingRead",
    "PlannedRecord",
    "Record",
    "Stream",
    "Writer",
    "__version__",
    "chunk_checksums",
    "codec_decode",
    "codec_decode_chain",
    "codec_decode_chain_span",
    "codec_decode_span",
    "codec_directory_end",
    "codec_encode",
    "codec_info",
    "codec_span",
    "copy_file",
    "crc32_combine",
    "crc32_mapped",
    "crc32_regions",
    "create_writer",
    "fast_dumps",
    "fast_weights_only_load",
    "free_page_reporting",
    "io_uring_status",
    "join_halves",
    "open_container",
    "probe_path",
    "prove_pieces",
    "read_blocks",
    "read_directory_stream",
    "read_ranges_verified",
    "route_pieces",
    "split_halves",
    "start_read",
    "transfer_ranges",
]

__version__: str

_PathLike = str | PathLike[str]
_Progress = Callable[[int, int], None] | None

@final
class Buffer:
    """An aligned engine buffer, exported through the buffer protocol."""

    def __len__(self) -> int: ...
    @property
    def address(self) -> int: ...

@final
class Engine:
    def __new__(
        cls,
        backend: str | None = None,
        *,
        queue_depth: int | None = None,
        chunk_bytes: int | None = None,
        pool_bytes: int | None = None,
        path_limit: int | None = None,
        cpu_threads: int | None = None,
        huge_pages: bool | None = None,
        forced_by: str | None = None,
    ) -> Engine: ...
    @property
    def mode(self) -> str: ...
    def info(self) -> dict[str, Any]: ...
    def set_background_rate(self, bytes_per_sec: int) -> None: ...
    @property
    def background_rate(self) -> int: ...
    def path_stats(self) -> dict[int, tuple[int, int]]: ...

@final
class PlannedRecord:
    """One record of a container being written, where the writer put it."""

    @property
    def name(self) -> str: ...
    @property
    def header_offset(self) -> int: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def crc32(self) -> int | None: ...

@final
class Writer:
    def add_bytes(self, name: str, data: bytes, align: int | None = None) -> int: ...
    def add_memory(
        self, name: str, address: int, nbytes: int, owner: object, gate: Gate | None = None, ready_at: int = 0
    ) -> int: ...
    def add_memories(self, records: Sequence[tuple[str, int, int, object]]) -> None: ...
    def start_data(self) -> None: ...
    def wait_data(self, progress: _Progress = None) -> list[int | None]: ...
    def write_data(self, progress: _Progress = None) -> list[int | None]: ...
    def commit(self, progress: _Progress = None) -> int: ...
    def abort(self) -> None: ...
    def chunk_table(self, index: int) -> bytes: ...
    def entries(self) -> list[PlannedRecord]: ...
    @property
    def records_end(self) -> int: ...
    @property
    def direct(self) -> bool: ...
    @property
    def buffered_reason(self) -> str | None: ...

@final
class Stream:
    def __new__(cls, *, align: int = 4096, chunk_bytes: int = 8388608, threads: int = 2) -> Stream: ...
    def add_bytes(self, name: str, data: bytes, align: int) -> int: ...
    def add_memories(self, records: Sequence[tuple[str, int, int, object]]) -> None: ...
    def checksums(self) -> list[int]: ...
    def entries(self) -> list[PlannedRecord]: ...
    def next_chunk(self) -> bytes | None: ...

def create_writer(
    engine: Engine,
    path: _PathLike,
    *,
    align: int = 4096,
    durable: bool = True,
    background: bool = False,
    chunk_sums: bool = False,
) -> Writer: ...
def probe_path(path: _PathLike) -> dict[str, Any]: ...
def copy_file(
    engine: Engine,
    src: _PathLike,
    dst: _PathLike,
    *,
    background: bool = True,
    durable: bool = True,
    reflink: bool = True,
) -> tuple[int, str]: ...
def io_uring_status() -> tuple[bool, str | None]: ...
def free_page_reporting() -> bool: ...

@final
class Record:
    """One record as the central directory describes it."""

    @property
    def name(self) -> str: ...
    @property
    def crc32(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def compressed_size(self) -> int: ...
    @property
    def method(self) -> int: ...
    @property
    def header_offset(self) -> int: ...

@final
class Container:
    """A container opened once: its validated directory and open file."""

    @property
    def path(self) -> str: ...
    @property
    def records(self) -> list[Record]: ...
    @property
    def cd_offset(self) -> int: ...
    @property
    def file_len(self) -> int: ...
    def local_data_offset(self, name: str) -> int: ...
    def read(self, offset: int, length: int, what: str) -> bytes: ...
    def check_offsets(self, offsets: list[tuple[str, int]]) -> None: ...
    def data_offsets(self) -> list[int]: ...

def open_container(path: _PathLike) -> Container: ...
def read_directory_stream(
    f: Any, start: int, avail: int, name: _PathLike
) -> tuple[list[Record], int, int, list[int]]: ...

@final
class Gate:
    def __new__(cls) -> Gate: ...
    def advance(self, to: int) -> None: ...
    def fail(self) -> None: ...
    @property
    def value(self) -> int: ...
    def copy_in(self, at: int, dst: int, src: int, nbytes: int) -> None: ...

@final
class PendingRead:
    @property
    def buffers(self) -> list[Buffer]: ...
    def wait(self, progress: _Progress = None) -> None: ...
    def abandon(self) -> None: ...

def start_read(
    engine: Engine,
    path: _PathLike,
    specs: list[tuple[str, int, int, int | None]],
    *,
    verify: bool = True,
    background: bool = False,
) -> PendingRead: ...
def fast_weights_only_load(
    data: bytes,
    allowed: dict[str, Any],
    blocked_modules: list[str],
    ordered_dict: type,
    counter: type,
    deferred_callables: list[Any],
    persistent_load: Callable[[Any], Any],
    substitute: tuple[Any, Any] | None = None,
) -> Any: ...
def fast_dumps(
    obj: object, tensor_type: type, ordered_dict: type, tensor_args: Callable[[Any], tuple[Any, ...] | None]
) -> bytes | None: ...
def transfer_ranges(
    engine: Engine,
    path: _PathLike,
    offsets: list[int],
    lengths: list[int],
    addrs: list[int],
    *,
    write: bool = False,
    size: int = 0,
    background: bool = False,
    direct: bool = False,
    turns: DeviceTurns | None = None,
    ticket: tuple[int, int] | None = None,
    crc32: int | None = None,
    record: str | None = None,
) -> int: ...

@final
class DeviceTurns:
    def __new__(
        cls,
        engine: Engine,
        dev: int,
        *,
        slots: int,
        exclusive: bool,
        shared: int,
        lock_dir: _PathLike,
        duplex: bool | None = None,
    ) -> DeviceTurns: ...
    def ticket(self, background: bool = False) -> tuple[int, int]: ...
    @property
    def dev(self) -> int: ...
    @property
    def duplex(self) -> bool: ...
    @duplex.setter
    def duplex(self, value: bool) -> None: ...
    def take_bytes(self) -> int: ...
    @property
    def lock_wait_s(self) -> float: ...
    def close(self) -> None: ...

def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int: ...
def crc32_regions(regions: list[tuple[int, int]], threads: int = 2) -> list[int]: ...
def crc32_mapped(regions: list[tuple[int, int]], threads: int = 2) -> tuple[list[int], tuple[int, int] | None]: ...
def chunk_checksums(engine: Engine, regions: list[tuple[int, int]], chunk: int, algo: str = "crc32c") -> bytes: ...
def read_ranges_verified(
    engine: Engine,
    path: _PathLike,
    offsets: list[int],
    lengths: list[int],
    dests: list[int],
    table_ids: list[int],
    tables: list[tuple[str, int, int, int, str, bytes]],
    *,
    full: bool = False,
    background: bool = False,
) -> tuple[int, int]: ...
def read_blocks(
    engine: Engine,
    path: _PathLike,
    blocks: bytes,
    dims: int,
    tables: list[tuple[str, int, int, int, str, bytes]],
    *,
    verify: str = "touched",
    background: bool = False,
) -> tuple[int, int, int, bytes, bytes]: ...
def prove_pieces(rows: bytes) -> bytes: ...
def route_pieces(rows: bytes, world: int) -> tuple[bytes, list[int]]: ...
def split_halves(src: int, hi: int, lo: int, n: int, threads: int = 1) -> None: ...
def join_halves(hi: int, lo: int, out: int, n: int, threads: int = 1) -> None: ...

# The tsz1 record codec (rust/core/src/codec.rs).
CODEC_HEADER: int
CODEC_ENTRY: int

def codec_encode(
    src: int,
    n: int,
    width: int,
    ref_addr: int = 0,
    ref_len: int = 0,
    *,
    level: int = 1,
    chunk: int = 1048576,
    threads: int = 1,
    transform: str | None = None,
) -> tuple[bytes, str, tuple[int, int, int, int, int]]: ...
def codec_decode(
    src: int,
    n: int,
    out: int,
    out_len: int,
    ref_addr: int = 0,
    ref_len: int = 0,
    *,
    threads: int = 1,
    path: str | None = None,
    record: str | None = None,
) -> None: ...
def codec_info(data: bytes, *, path: str | None = None, record: str | None = None) -> dict[str, Any]: ...
def codec_decode_chain(
    srcs: list[tuple[int, int]],
    out: int,
    out_len: int,
    *,
    threads: int = 1,
    path: str | None = None,
    record: str | None = None,
) -> bool: ...
def codec_decode_chain_span(
    heads: list[bytes],
    payload_lens: list[int],
    windows: list[bytes],
    bases: list[int],
    first: int,
    last: int,
    out: tuple[int, int],
    *,
    threads: int = 1,
    path: str | None = None,
    record: str | None = None,
) -> bool: ...
def codec_directory_end(first: bytes, *, path: str | None = None, record: str | None = None) -> int: ...
def codec_span(
    head: bytes,
    payload_len: int,
    lo: int,
    hi: int,
    *,
    path: str | None = None,
    record: str | None = None,
) -> tuple[int, int, int, int, int, int]: ...
def codec_decode_span(
    head: bytes,
    payload_len: int,
    sp: tuple[int, int, int, int, int, int],
    window: bytes,
    out: tuple[int, int],
    reference: tuple[int, int] | None = None,
    *,
    threads: int = 1,
    path: str | None = None,
    record: str | None = None,
) -> None: ...
