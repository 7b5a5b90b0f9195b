"""A step's rows and their settings turned into a typed plan, once per step for all layers.

One rule per row (:class:`KernelPlan`, made by :func:`kernel_plan`): its θ, window, leak,
Self-Extend group, log-n length and query factor, each ntk_dynamic row cut where its θ steps.
The Triton kernels read it as it is and form every angle themselves. For the CPU ops the
:class:`StepPlanner` makes the rotation tables from it, in one place: for every query token
the rotations of its near and far query; for every prefill row, where its near band and far
part lie; for all decode rows together, which cache blocks to read, which keys to keep, the
band keys' rotations and which far-key table each row uses. Those tensors are built here, on
the CPU, so the ops only index and compute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rope_plugins.ops import native
from rope_plugins.rules.rotary import dynamic_length, log_n_scale
from rope_plugins.rules.settings import DYNAMIC_STEP
from rope_plugins.worker.row_tables import RowTables

FAR_TABLES_KEPT = 16  # far-key rotation tables kept between steps (one per distinct (θ, ρ))

DECODE_FAR_STEP = 64  # the C++ decode turns the far query once per this many keys (it divides csrc's kDecodeChunk)

# the Triton kernels' tiling (rope_plugins/ops/gpu.py)
QUERY_TILE = 128  # queries per Triton prefill program (the fastest on an H200, ops/gpu.py)
KEY_TILE = 32  # keys per inner step of the C++ prefill (csrc/attention_inputs.h)
DECODE_KEY_TILE = 64  # keys per inner step of the Triton decode (the fastest on an H200, ops/gpu.py)
DECODE_SPLITS = 16  # splits of the longest decode row (each at least MIN_SPLIT_KEYS keys)
MIN_SPLIT_KEYS = 256


@dataclass(frozen=True)
class Rotation:
    """cos and sin of float64 angles, cast to float32 at the cosine (angles stay exact to 1e-12).
    float32 whatever the model's dtype: the C++ kernels read float32 tables, and in bfloat16 a
    cosine would keep 3 significant digits."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, angle: torch.Tensor) -> "Rotation":
        return cls(cos=angle.cos().float(), sin=angle.sin().float())

    def __getitem__(self, index) -> "Rotation":
        return Rotation(cos=self.cos[index], sin=self.sin[index])


@dataclass(frozen=True)
class QueryPlan:
    """Every query token of the step: ``[T]`` scale, ``[T, 1, d/2]`` rotations."""

    scale: torch.Tensor  # log-n x the method's factor, float32
    near: Rotation  # m θ
    far: Rotation  # (o + (m - w) ρ) θ; grouped: (⌊m/g⌋ + w - ⌊w/g⌋) θ; chunked: o θ
    window: torch.Tensor  # [T] int64: the query's window w(m) (query_windows)


@dataclass(frozen=True)
class PrefillRow:
    """One request with more than one query token this step: its near band (``0 <= m - n < w(m)``)
    lies in keys ``band_start ..``, its far part (``n <= m - w(m)``) anywhere before."""

    tokens: slice  # its query tokens in the step's flat token order
    context: int  # tokens already in the cache before this chunk
    seq_len: int  # context + chunk
    row: int  # batch row (block table)
    near_from: torch.Tensor  # [chunk] int64: each query's first near key, m - w(m) + 1
    far_keys: Rotation | None  # n ρ θ (grouped: ⌊n/g⌋ θ, chunked: (n mod s) θ), [seq_len, 1, d/2]; None when ρ = 0
    band_start: int = 0  # the first key position any near query sees
    band_keys: Rotation | None = None  # n θ for n = band_start .. seq_len - 1, [n, 1, d/2]

    @property
    def chunk(self) -> int:
        return self.tokens.stop - self.tokens.start


@dataclass(frozen=True)
class DecodeBand:
    """The near-band keys of every decode row, ``[Rd, W]`` (W the widest window)."""

    block: torch.Tensor  # block index in the row's block table
    offset: torch.Tensor  # slot in that block
    target: torch.Tensor  # the key's column among the row's keys; a spare last column when outside the band
    keys: Rotation  # n θ, [Rd, W, 1, d/2]


@dataclass(frozen=True)
class FarKeys:
    """Far-key rotations ``n ρ θ`` (grouped: ``⌊n/g⌋ θ``): one table per distinct setting with ``ρ != 0``."""

    tables: tuple[Rotation, ...]  # [nb * bs, d/2] each
    table_of_row: torch.Tensor  # [Rd] int64; -1 when ρ = 0 (old keys read raw)

    @functools.cached_property
    def rotation(self) -> Rotation:
        """All tables stacked, ``[U, nb * bs, d/2]``."""
        return Rotation(cos=torch.stack([t.cos for t in self.tables]), sin=torch.stack([t.sin for t in self.tables]))

    def every(self, step: int) -> Rotation:
        """The angles of positions ``0, step, 2 step, ...``: ``[U, ceil(nb * bs / step), d/2]``."""
        return Rotation(cos=torch.stack([t.cos[::step] for t in self.tables]),
                        sin=torch.stack([t.sin[::step] for t in self.tables]))

    def first(self, step: int) -> Rotation:
        """The angles of positions ``0 .. step - 1``: ``[U, step, d/2]``."""
        return Rotation(cos=torch.stack([t.cos[:step] for t in self.tables]),
                        sin=torch.stack([t.sin[:step] for t in self.tables]))


@dataclass(frozen=True)
class DecodePlan:
    """All decode rows (one query each), batched over rows and cache blocks."""

    tokens: torch.Tensor | slice  # [Rd] token index of each row's query (a slice when they are consecutive)
    block_ids: torch.Tensor  # [Rd, nb]
    keep: torch.Tensor  # [Rd, nb * bs] keys each row attends to
    seq_lens: torch.Tensor  # [Rd] int64
    window: torch.Tensor  # [Rd] int64
    band_start: torch.Tensor  # [Rd] int64: first key position of the band
    far_keys: FarKeys | None
    band: DecodeBand | None
    query_scale: torch.Tensor  # [Rd]
    query_rotation: Rotation  # [Rd, 2, d/2]: the near angle, then the far angle

    @functools.cached_property
    def kernel_inputs(self):
        """The C++ decode's inputs (csrc/attention_inputs.h), packed once per step for every layer's call."""
        rows, half = self.query_scale.shape[0], self.query_rotation.cos.shape[-1]
        empty = self.query_rotation.cos.new_empty(0)
        none = Rotation(cos=empty, sin=empty)
        near = none if self.band is None else Rotation(cos=self.band.keys.cos.reshape(rows, -1, half),
                                                       sin=self.band.keys.sin.reshape(rows, -1, half))
        far = self.far_keys
        steps = none if far is None else far.every(DECODE_FAR_STEP)
        offsets = none if far is None else far.first(DECODE_FAR_STEP)
        return native.decode_inputs(
            query_scale=self.query_scale, query_cos=self.query_rotation.cos, query_sin=self.query_rotation.sin,
            block_table=self.block_ids, seq_lens=self.seq_lens, window=self.window, band_start=self.band_start,
            near_cos=near.cos, near_sin=near.sin, far_step_cos=steps.cos, far_step_sin=steps.sin,
            far_offset_cos=offsets.cos, far_offset_sin=offsets.sin,
            far_table=torch.full((rows,), -1, dtype=torch.int64) if far is None else far.table_of_row)


@dataclass(frozen=True)
class PrefillTiles:
    """The Triton prefill's programs: tile ``i`` is queries ``start[i] .. + size`` of the
    chunk of batch row ``row[i]``."""

    row: torch.Tensor  # [tiles] int32
    start: torch.Tensor  # [tiles] int32
    size: int


@dataclass(frozen=True)
class DecodeRows:
    """The Triton decode's rows (one query each) and its split of their keys."""

    row: torch.Tensor  # [Rd] int32 batch rows
    split_keys: int  # keys per split
    splits: int  # splits of the longest row; a shorter row's last ones are empty


@dataclass(frozen=True)
class KernelPlan:
    """The attention metadata of one step for the Triton kernels: each row's rule as numbers
    (the kernels form every angle themselves), on the device."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T]
    block_table: torch.Tensor  # [R, max_blocks]
    query_start: torch.Tensor  # [R + 1]
    seq_lens: torch.Tensor  # [R]
    theta: torch.Tensor  # [R, d/2] float64
    window: torch.Tensor  # [R] int64
    leak: torch.Tensor  # [R] float64
    far_origin: torch.Tensor  # [R] int64
    log_n_length: torch.Tensor  # [R] float64
    query_factor: torch.Tensor  # [R] float64
    group: torch.Tensor  # [R] int64
    chunk_length: torch.Tensor  # [R] int64: dual-chunk's s; 0 elsewhere
    prefill_tiles: PrefillTiles | None
    decode_rows: DecodeRows | None


@dataclass(frozen=True)
class StepPlan:
    """The attention metadata of one step for the CPU ops: the rows' rule, the very
    :class:`KernelPlan` the Triton kernels read, and the rotation tables made from it."""

    rows: KernelPlan
    query: QueryPlan
    prefill: list[PrefillRow]
    decode: DecodePlan | None

    @property
    def num_actual_tokens(self) -> int:
        return self.rows.num_actual_tokens

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.rows.slot_mapping

    @property
    def block_table(self) -> torch.Tensor:
        return self.rows.block_table


def decode_split(longest: int, *, min_split_keys: int = MIN_SPLIT_KEYS) -> tuple[int, int]:
    """Keys per split (a multiple of the decode's key tile: its tiles start at multiples of their
    size) and the number of splits, for decode rows of at most ``longest`` keys: enough programs
    to fill a GPU, none shorter than ``min_split_keys``."""
    split_keys = max(min_split_keys, -(-longest // DECODE_SPLITS))
    split_keys = -(-split_keys // DECODE_KEY_TILE) * DECODE_KEY_TILE
    return split_keys, -(-longest // split_keys)


def kernel_plan(tables: RowTables, *, query_start_cpu: torch.Tensor, query_start: torch.Tensor,
                seq_lens: torch.Tensor, max_seq_len: int, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                query_tile: int = QUERY_TILE, min_split_keys: int = MIN_SPLIT_KEYS) -> KernelPlan:
    """The step's :class:`KernelPlan`. ``tables`` row i is batch row i (CPU); the batch's
    tensors are on the device already; only the row starts are read on the host."""
    pieces = dynamic_sub_rows(tables, query_start_cpu[: seq_lens.numel() + 1].to(torch.int64), seq_lens)
    if pieces is not None:
        tables, query_start_cpu = pieces.tables, pieces.starts.to(query_start_cpu.dtype)
        query_start = query_start_cpu.to(query_start.device)
        seq_lens = pieces.seq_lens.to(seq_lens.device, seq_lens.dtype)
        block_table = block_table[pieces.batch_row.to(block_table.device)]
    device, rows = query_start.device, seq_lens.numel()
    query_lens = (query_start_cpu[1: rows + 1] - query_start_cpu[:rows]).to(torch.int64)
    prefill = (query_lens > 1).nonzero().flatten()
    tiles = None
    if prefill.numel():
        per_row = -(-query_lens[prefill] // query_tile)
        row = torch.repeat_interleave(prefill, per_row)
        first_tile = torch.cumsum(per_row, 0) - per_row
        start = (torch.arange(row.numel()) - torch.repeat_interleave(first_tile, per_row)) * query_tile
        tiles = PrefillTiles(row=row.to(device, torch.int32), start=start.to(device, torch.int32), size=query_tile)
    decode = (query_lens == 1).nonzero().flatten()
    decode_rows = None
    if decode.numel():
        split_keys, splits = decode_split(max_seq_len, min_split_keys=min_split_keys)
        decode_rows = DecodeRows(row=decode.to(device, torch.int32), split_keys=split_keys, splits=splits)
    on_device = lambda table: table[:rows].to(device, non_blocking=True)  # noqa: E731
    return KernelPlan(
        num_actual_tokens=int(query_start_cpu[rows]), slot_mapping=slot_mapping, block_table=block_table,
        query_start=query_start[: rows + 1], seq_lens=seq_lens, theta=on_device(tables.theta),
        window=on_device(tables.window), leak=on_device(tables.leak), far_origin=on_device(tables.far_origin),
        log_n_length=on_device(tables.log_n_length),
        query_factor=on_device(tables.query_factor), group=on_device(tables.group),
        chunk_length=on_device(tables.chunk_length), prefill_tiles=tiles,
        decode_rows=decode_rows)


@dataclass(frozen=True)
class SubRows:
    """A step's rows with each ntk_dynamic row cut where its rotation changes: every row here
    has one θ for all its queries, so every kernel runs it unchanged. Row i reads the cache
    through batch row ``batch_row[i]``."""

    tables: RowTables  # [R'] with each piece's θ
    starts: torch.Tensor  # [R' + 1] int64
    seq_lens: torch.Tensor  # [R'] int64: each piece's last query position + 1
    batch_row: torch.Tensor  # [R'] int64


def dynamic_sub_rows(tables: RowTables, starts: torch.Tensor, seq_lens: torch.Tensor,
                     step: int = DYNAMIC_STEP) -> SubRows | None:
    """The step's rows (``starts [R+1]``, ``seq_lens [R]``, ``tables`` row i = batch row i) with
    each ntk_dynamic row's queries cut at the positions ``L + j step`` where its factor steps
    (:func:`rotary.dynamic_length`), each piece at its own ``θ k^(-e)``; None without such a row.
    A piece attends to keys up to its own last query, as any causal row; pieces are consecutive
    in the token order, so outputs land where the row's would. ``seq_lens`` may be on a device:
    it is read on the host only when there is such a row."""
    rows = seq_lens.numel()
    train_lengths = tables.dynamic_length[:rows]
    if not bool((train_lengths > 0).any()):
        return None
    seq_lens = seq_lens.to("cpu", torch.int64)
    piece_starts, piece_ends, batch_row = [], [], []
    for r in range(rows):
        end, first_token = int(seq_lens[r]), int(starts[r])
        first = end - (int(starts[r + 1]) - first_token)  # the row's first query position
        cuts, train = [first], int(train_lengths[r])
        if train:
            cut = train + max(0, (first - train) // step + 1) * step  # the first step after `first`
            cuts += range(cut, end, step)
        for a, b in zip(cuts, cuts[1:] + [end]):
            piece_starts.append(first_token + a - first)
            piece_ends.append(b)
            batch_row.append(r)
    batch_row = torch.tensor(batch_row, dtype=torch.int64)
    seq_lens_out = torch.tensor(piece_ends, dtype=torch.int64)
    pieces = tables.gather(batch_row)
    train = pieces.dynamic_length.clamp(min=1).double()  # fixed rows have exponent 0: their factor is moot
    factor = dynamic_length(seq_lens_out - 1, train, step) / train  # each piece's last query's (its queries share it)
    pieces.theta = pieces.theta * factor[:, None] ** -pieces.theta_exponent
    return SubRows(tables=pieces, starts=torch.tensor(piece_starts + [int(starts[rows])], dtype=torch.int64),
                   seq_lens=seq_lens_out, batch_row=batch_row)


def query_windows(positions: torch.Tensor, window: torch.Tensor, far_origin: torch.Tensor,
                  chunk_length: torch.Tensor) -> torch.Tensor:
    """Each query's window ``w(m)`` (int64): keys at ``m - n < w(m)`` are near. The row's ``w``, but
    in chunks of ``s`` (dual-chunk attention, local window ``l = o - s``) the keys of the query's
    own chunk, and of the chunk before while ``m mod s <= l``: ``m mod s + 1``, plus ``s`` then."""
    chunks = chunk_length.clamp(min=1)
    offset = positions % chunks
    chunked = offset + 1 + torch.where(offset <= far_origin - chunk_length, chunk_length, 0)
    return torch.where(chunk_length > 0, chunked, window)


def far_query_positions(positions: torch.Tensor, window: torch.Tensor, leak: torch.Tensor, far_origin: torch.Tensor,
                        group: torch.Tensor, chunk_length: torch.Tensor) -> torch.Tensor:
    """Where each query (0-based ``positions``, int64) stands for its far keys, float64:
    ``o + (m - w) ρ``; with positions grouped (``g > 0``, Self-Extend) ``⌊m/g⌋ + w - ⌊w/g⌋``; in
    chunks (dual-chunk attention) ``o`` whatever ``m``."""
    groups = group.clamp(min=1)
    grouped = (positions // groups + window - window // groups).to(torch.float64)
    continuous = torch.where(chunk_length > 0, far_origin.to(torch.float64), far_origin + (positions - window) * leak)
    return torch.where(group > 0, grouped, continuous)


def far_key_positions(positions: torch.Tensor, leak: float, group: int, chunk_length: int) -> torch.Tensor:
    """Where keys at ``positions`` (int64) stand for far queries, float64: ``n ρ``; grouped ``⌊n/g⌋``;
    in chunks of ``s`` ``n mod s``."""
    if chunk_length:
        return (positions % chunk_length).to(torch.float64)
    return (positions // group).to(torch.float64) if group else positions.to(torch.float64) * leak


def log_n_factor(positions: torch.Tensor, log_n_length: torch.Tensor) -> torch.Tensor:
    """Per token log-n factor under its row's training length; 1 where ``log_n_length`` is 0."""
    factor = log_n_scale(positions, log_n_length.clamp(min=2.0))
    return torch.where(log_n_length > 0, factor, torch.ones_like(factor))


class StepPlanner:
    """Makes :class:`StepPlan` s; keeps far-key tables between steps (keys keep their angle)."""

    def __init__(self, *, block_size: int) -> None:
        self.block_size = block_size
        self.far_tables: dict[tuple, Rotation] = {}

    def plan(self, tables: RowTables, starts: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor) -> StepPlan:
        """The step's plan from row starts ``[R+1]`` in the flat token order, sequence lengths
        ``[R]`` (int64), the block table, the slots, and the rows' settings tables, all on the CPU."""
        rows = kernel_plan(tables, query_start_cpu=starts, query_start=starts, seq_lens=seq_lens,
                           max_seq_len=int(seq_lens.max()) if seq_lens.numel() else 0, block_table=block_table,
                           slot_mapping=slot_mapping)
        query_lens = rows.query_start.diff()
        decode = (query_lens == 1).nonzero().flatten()
        query = self.query_plan(rows, query_lens)
        return StepPlan(rows=rows, query=query,
                        prefill=[self.prefill_row(rows, query, row)
                                 for row in (query_lens > 1).nonzero().flatten().tolist()],
                        decode=self.decode_plan(rows, decode, query) if decode.numel() else None)

    def query_plan(self, rows: KernelPlan, query_lens: torch.Tensor) -> QueryPlan:
        tokens = rows.num_actual_tokens
        token_row = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens, output_size=tokens)
        # position of each token: the request's context plus its offset in the chunk
        positions = (rows.seq_lens - query_lens)[token_row] + torch.arange(tokens) - rows.query_start[:-1][token_row]
        theta = rows.theta[token_row]  # [T, d/2]
        window, far_origin = rows.window[token_row], rows.far_origin[token_row]
        chunk_length = rows.chunk_length[token_row]
        far_position = far_query_positions(positions, window, rows.leak[token_row], far_origin, rows.group[token_row],
                                           chunk_length)
        scale = log_n_factor(positions, rows.log_n_length[token_row]) * rows.query_factor[token_row]
        return QueryPlan(scale=scale.float(),
                         near=Rotation.of((positions[:, None].double() * theta)[:, None]),
                         far=Rotation.of((far_position[:, None] * theta)[:, None]),
                         window=query_windows(positions, window, far_origin, chunk_length))

    def far_key_table(self, theta: torch.Tensor, leak: float, group: int, chunk_length: int, length: int) -> Rotation:
        """The far angles of key positions ``n < length`` (:func:`far_key_positions` x θ),
        ``[length, d/2]``; computed once per setting (and per doubling of the length), not every step."""
        key = (leak, group, chunk_length, theta.numpy().tobytes())
        table = self.far_tables.pop(key, None)  # re-inserted below: the dict is kept in use order
        if table is None or table.cos.shape[0] < length:
            capacity = max(1024, 1 << (length - 1).bit_length())
            positions = far_key_positions(torch.arange(capacity), leak, group, chunk_length)
            table = Rotation.of(positions[:, None] * theta)
        self.far_tables[key] = table
        while len(self.far_tables) > FAR_TABLES_KEPT:
            self.far_tables.pop(next(iter(self.far_tables)))
        return table[:length]

    def decode_plan(self, rows: KernelPlan, decode: torch.Tensor, query: QueryPlan) -> DecodePlan:
        """Blocks to read, keys to keep, far-key tables and the near band of every decode row."""
        seq_lens = rows.seq_lens[decode]
        keys = -(-int(seq_lens.max()) // self.block_size) * self.block_size  # the rows' key columns
        tokens = rows.query_start[:-1][decode]
        if torch.equal(tokens, torch.arange(int(tokens[0]), int(tokens[0]) + tokens.numel())):
            tokens = slice(int(tokens[0]), int(tokens[0]) + tokens.numel())  # views instead of gathers
        window = query.window[tokens]
        band_width = min(int(window.max()), int(seq_lens.max()))
        near, far = query.near[tokens], query.far[tokens]  # [Rd, 1, d/2]
        both = Rotation(cos=torch.cat((near.cos, far.cos), dim=1), sin=torch.cat((near.sin, far.sin), dim=1))
        return DecodePlan(
            tokens=tokens, query_scale=query.scale[tokens], query_rotation=both,
            block_ids=rows.block_table[decode, : keys // self.block_size].to(torch.int64),
            keep=torch.arange(keys)[None, :] < seq_lens[:, None], seq_lens=seq_lens, window=window,
            band_start=(seq_lens - band_width).clamp(min=0),
            far_keys=self.decode_far_keys(rows.theta[decode], rows.leak[decode], rows.group[decode],
                                          rows.chunk_length[decode], keys),
            band=self.decode_band(rows.theta[decode], seq_lens, window, band_width, keys) if band_width > 0 else None)

    def decode_far_keys(self, theta: torch.Tensor, leak: torch.Tensor, group: torch.Tensor, chunk_length: torch.Tensor,
                        keys: int) -> FarKeys | None:
        """One far-key table per distinct (θ, ρ != 0, g, s) among the decode rows."""
        table_of_row, table_of_setting, tables = torch.full((leak.numel(),), -1, dtype=torch.int64), {}, []
        for r in (leak != 0).nonzero().flatten().tolist():
            setting = (float(leak[r]), int(group[r]), int(chunk_length[r]), theta[r].numpy().tobytes())
            if setting not in table_of_setting:
                table_of_setting[setting] = len(tables)
                tables.append(self.far_key_table(theta[r], *setting[:3], keys))
            table_of_row[r] = table_of_setting[setting]
        return FarKeys(tables=tuple(tables), table_of_row=table_of_row) if tables else None

    def decode_band(self, theta: torch.Tensor, seq_lens: torch.Tensor, window: torch.Tensor, band_width: int,
                    keys: int) -> DecodeBand:
        """The last ``band_width`` key positions of each row; those within its own window are
        near keys, the rest of the band goes to a spare column."""
        position = (seq_lens - band_width).clamp(min=0)[:, None] + torch.arange(band_width)  # [Rd, W]
        near = (position < seq_lens[:, None]) & (seq_lens[:, None] - 1 - position < window[:, None])
        position = position.clamp(max=keys - 1)
        return DecodeBand(block=position // self.block_size, offset=position % self.block_size,
                          target=torch.where(near, position, keys),
                          keys=Rotation.of((position.double()[..., None] * theta[:, None, :])[:, :, None]))

    def prefill_row(self, rows: KernelPlan, query: QueryPlan, row: int) -> PrefillRow:
        first, end, seq_len = int(rows.query_start[row]), int(rows.query_start[row + 1]), int(rows.seq_lens[row])
        chunk = end - first
        context, leak, theta = seq_len - chunk, float(rows.leak[row]), rows.theta[row]
        window = query.window[first:end]
        near_from = context + torch.arange(chunk) - window + 1
        band_start, band_keys = 0, None
        if bool((window > 0).any()):
            band_start = max(0, int(near_from.min()))
            positions = torch.arange(band_start, seq_len, dtype=torch.float64)
            band_keys = Rotation.of((positions[:, None] * theta)[:, None])
        far_keys = None
        if leak != 0:
            far_keys = self.far_key_table(theta, leak, int(rows.group[row]), int(rows.chunk_length[row]),
                                          seq_len)[:, None]
        return PrefillRow(tokens=slice(first, end), context=context,
                          seq_len=seq_len, row=row, near_from=near_from, far_keys=far_keys, band_start=band_start,
                          band_keys=band_keys)
