"""Copies and near-copies in an image folder, found so that a split can keep each group on one side.

    exact   the same decoded pixels (not the same file bytes: a PNG and its re-save, a file and its copy)
    near    the same picture re-encoded (JPEG), resized, slightly brightened or cropped

Each image is decoded once (in a pool of processes on large folders) into three things: a digest of its
pixels, a 64-bit perceptual hash (the DCT hash of Zauner's pHash, as `imagehash.phash` computes it, written
here in batch with scipy's DCT rather than adding a dependency for it, from a 32 x 32 grey thumbnail) and a
grey copy at its own size, shrunk to fit `SMALL` x `SMALL` when larger (never enlarged).

Near-copy search is sub-quadratic: multi-index hashing (Norouzi et al., 2012) cuts each hash into bands of 8
to 16 bits (`band_bits`: wider as the folder grows, so a band's bucket stays small), and only images that share
a whole band are compared. Two hashes that differ in fewer bits than there are bands always share one
(pigeonhole), and most within `MAX_HAMMING` do.

A candidate pair (hashes within `MAX_HAMMING` bits) is then checked pixel by pixel (`pixel_distance`): the
larger grey copy is shrunk to the smaller's size, so a resized copy is compared where it has detail and not
through an enlargement; both are blurred by `BLUR` pixels (what re-encoding and resampling change is fine
detail; what tells two photos of one garment apart is where their outlines run) and scaled to zero mean and unit
variance (so a brightened copy matches). The pair is kept when the 99th percentile of their absolute difference
is at most `MAX_DIFF`: an outline moved by a pixel or two exceeds it, which a correlation of whole thumbnails
does not notice (a crop moves every outline, so a cropped copy is rarely found). Groups are the connected parts
of the pairs. A pair whose colours differ (`colour_distance`: a red shirt and the same shirt in green, which the
grey copies cannot tell apart; a colour picture and its grey copy) is no near-copy.
Figures: BENCHMARKS.md, "Copies and near-copies".

Shapes: n images, T = THUMB (thumbnail side), S = SMALL (the grey copies' largest side), m pairs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
from PIL import Image
from scipy.fft import dctn
from scipy.ndimage import gaussian_filter
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from serve.runtime.images import ImageError, load_image, open_image
from train.parallel import parallel_map

PARALLEL_FROM = 500  # images; fewer are decoded in this process (a pool costs more than it saves)
THUMB = 32  # side of the grey thumbnail: pHash's DCT input
SMALL = 32  # largest side of the grey copy a candidate pair is compared on (as much memory as the thumbnail)
BUCKET = 64  # images a band's bucket holds on average (`band_bits`)
# Set on Fashion-MNIST (benchmarks/duplicates.py), whose garments photographed alike are the hard case:
# looser, and distinct images of a class group; tighter, and copies re-encoded at another size are missed.
MAX_HAMMING = 10  # bits two hashes of one picture may differ by
BLUR = 1.0  # pixels (Gaussian sigma, at the compared size) that hide re-encoding and resampling noise
MAX_DIFF = 0.3  # 99th percentile of a pair's absolute difference, in standard deviations of the images
FLAT = 1.0  # grey levels of spread under which an image is one colour, and is no near-copy of anything
# A pair's colour distance (`colour_distance`) past which its colours differ: far above what re-encoding, brightening
# or cropping moves it, far below red against green (tests/train/test_duplicates.py)
MAX_CHROMA = 0.3
INK = 40  # max - min of R, G and B from which a pixel is coloured, not grey
MIN_INK = 0.02  # share of an image's pixels that must be coloured for it to have a colour
GREY = 0.005  # share of coloured pixels under which an image is grey (between the two: too little to tell)


@dataclass
class ImageFacts:
    """What one decoding pass learns of each image (row i is `paths[i]`)."""

    paths: list[str]
    sizes: np.ndarray  # (n, 2) width, height as stored
    modes: list[str]  # as stored: "RGB", "L", "P", ...
    digests: list[bytes]  # of the decoded RGB pixels and their shape
    hashes: np.ndarray  # (n,) uint64 perceptual hashes
    smalls: np.ndarray  # (n, S, S) uint8 grey copies, each in its top-left (height, width) = small_sizes[i]
    small_sizes: np.ndarray  # (n, 2) height, width
    colours: np.ndarray  # (n, 4) float32 chromaticity of each image's coloured pixels and their share (`ink`)
    broken: list[tuple[str, str]] = field(default_factory=list)  # (path, reason): did not decode


@dataclass
class Duplicates:
    """Groups of copies: each group is sorted, of 2 or more paths; `exact` holds the paths whose pixels equal
    another member's."""

    groups: list[list[str]]
    exact: set[str]

    def kind(self, path: str) -> str:
        return "exact" if path in self.exact else "near"

    def anchors(self) -> dict[str, str]:
        """Every member but the first of its group -> the group's first (sorted) path."""
        return {p: g[0] for g in self.groups for p in g[1:]}

    def counts(self) -> dict[str, int]:
        """`exact_groups` (every member the same pixels) and `near_groups` (the others)."""
        exact = sum(all(p in self.exact for p in g) for g in self.groups)
        return {"exact_groups": exact, "near_groups": len(self.groups) - exact}


def phash(grey: np.ndarray) -> np.ndarray:
    """64-bit DCT hashes of (n, 32, 32) grey images: bit k is set when DCT coefficient k of the 8 x 8 lowest
    frequencies is above their median (imagehash.phash's definition). Returns (n,) uint64."""
    low = dctn(grey.astype(np.float32), type=2, axes=(1, 2))[:, :8, :8].reshape(len(grey), 64)  # (n, 64)
    bits = low > np.median(low, axis=1, keepdims=True)
    return np.packbits(bits, axis=1, bitorder="little").view("<u8").ravel()


def _small(grey: Image.Image) -> Image.Image:
    """`grey` shrunk to fit `SMALL` x `SMALL`, its aspect kept; a smaller image is kept as it is."""
    w, h = grey.size
    if max(w, h) <= SMALL:
        return grey
    scale = SMALL / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return grey.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0)


def _facts(paths: list[str]) -> tuple:
    sizes, modes, digests, greys, smalls, colours, broken, ok = [], [], [], [], [], [], [], []
    for p in paths:
        try:
            header = open_image(p)
            size, mode = header.size, header.mode
            rgb = load_image(header)
        except (ImageError, OSError) as e:
            broken.append((p, str(e)))
            continue
        pixels = np.asarray(rgb)
        digests.append(hashlib.blake2b(repr(pixels.shape).encode() + pixels.tobytes(), digest_size=16).digest())
        grey = rgb.convert("L")
        greys.append(np.asarray(grey.resize((THUMB, THUMB), Image.Resampling.BILINEAR, reducing_gap=2.0)))
        smalls.append(np.asarray(_small(grey)))
        colours.append(ink(np.asarray(rgb.resize((THUMB, THUMB), Image.Resampling.BILINEAR, reducing_gap=2.0))))
        sizes.append(size)
        modes.append(mode)
        ok.append(p)
    thumbs = np.stack(greys) if greys else np.zeros((0, THUMB, THUMB), np.uint8)  # (n, T, T)
    padded = np.zeros((len(smalls), SMALL, SMALL), np.uint8)  # (n, S, S)
    for k, a in enumerate(smalls):
        padded[k, : a.shape[0], : a.shape[1]] = a
    small_sizes = np.array([a.shape for a in smalls], np.int64).reshape(-1, 2)
    grid = np.stack(colours) if colours else np.zeros((0, 4), np.float32)
    return ok, sizes, modes, digests, phash(thumbs), padded, small_sizes, grid, broken


def image_facts(paths: list[str], workers: int | None = None, chunk: int = 500) -> ImageFacts:
    """Decode every image once (in a process pool from `PARALLEL_FROM` images) and learn what `ImageFacts` holds."""
    from train.dataset import usable_cores

    workers = workers or usable_cores()
    if len(paths) < PARALLEL_FROM or workers < 2:
        parts = [_facts(paths)]
    else:
        chunks = [paths[i : i + chunk] for i in range(0, len(paths), chunk)]
        parts = parallel_map(_facts, chunks, workers)
    return ImageFacts(
        paths=[p for part in parts for p in part[0]],
        sizes=np.array([s for part in parts for s in part[1]], dtype=np.int64).reshape(-1, 2),
        modes=[m for part in parts for m in part[2]],
        digests=[d for part in parts for d in part[3]],
        hashes=np.concatenate([part[4] for part in parts]),
        smalls=np.concatenate([part[5] for part in parts]),
        small_sizes=np.concatenate([part[6] for part in parts]),
        colours=np.concatenate([part[7] for part in parts]),
        broken=[b for part in parts for b in part[8]],
    )


def band_bits(n: int) -> int:
    """Bits per band for `n` hashes: buckets of about `BUCKET` images, between 8 and 16 bits.

    Narrow bands on small folders find more pairs at little cost; wide ones keep a large folder's candidates
    (about `bands * BUCKET` an image) from growing with the folder.
    """
    return int(min(16, max(8, np.ceil(np.log2(max(n, 1) / BUCKET)))))


def band_pairs(hashes: np.ndarray, max_bits: int = 64, bits: int | None = None) -> np.ndarray:
    """Index pairs (i < j) of hashes that share at least one whole band and differ in at most `max_bits` bits.

    Args:
        hashes: (n,) uint64.
        max_bits: the most bits a pair may differ by (64 keeps every candidate).
        bits: bits per band (default `band_bits(n)`); `64 // bits` bands.

    Returns:
        (m, 2) int64, each pair once. Work grows with the candidates, not with n squared: equal band values are
        made adjacent by a sort, each run of equal values gives its pairs, and far pairs are dropped at once.
    """
    n = len(hashes)
    bits = bits or band_bits(n)
    found = [np.zeros((0, 2), np.int64)]
    for b in range(64 // bits):
        keys = (hashes >> np.uint64(b * bits)) & np.uint64((1 << bits) - 1)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        ends = np.repeat(np.r_[starts[1:], n], np.diff(np.r_[starts, n]))  # (n,) where each run ends
        at, step = np.flatnonzero(ends - np.arange(n) > 1), 1
        while at.size:  # pair each position with the one `step` further along its run
            at = at[at + step < ends[at]]
            i, j = order[at], order[at + step]
            close = hamming(hashes[i], hashes[j]) <= max_bits
            found.append(np.stack([i[close], j[close]], axis=1))
            step += 1
    return np.unique(np.sort(np.concatenate(found), axis=1), axis=0)


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bits that differ between the uint64 hashes `a` and `b` (same shape)."""
    return np.bitwise_count(a ^ b)


def _prepared(grey: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k, h, w) grey images blurred by `BLUR` and scaled to zero mean and unit variance; and their (k,) spread
    (standard deviation in grey levels) before the scaling."""
    x = gaussian_filter(grey.astype(np.float32), sigma=(0, BLUR, BLUR), mode="nearest")  # (k, h, w)
    x -= x.mean(axis=(1, 2), keepdims=True)
    spread = x.std(axis=(1, 2), keepdims=True)
    return x / np.maximum(spread, FLAT), spread.ravel()


def _shrunk(smalls: np.ndarray, small_sizes: np.ndarray, idx: np.ndarray, h: int, w: int) -> np.ndarray:
    """(k, h, w) the grey copies `idx`, each resized to (h, w) where it is not that size already."""
    out = smalls[idx, :h, :w].copy()
    for k in np.flatnonzero((small_sizes[idx] != (h, w)).any(axis=1)):
        hk, wk = small_sizes[idx[k]]
        grey = Image.fromarray(smalls[idx[k], :hk, :wk])
        out[k] = np.asarray(grey.resize((int(w), int(h)), Image.Resampling.BILINEAR, reducing_gap=2.0))
    return out


def pixel_distance(smalls: np.ndarray, small_sizes: np.ndarray, pairs: np.ndarray, block: int = 20_000) -> np.ndarray:
    """How far apart the two images of each pair are, pixel by pixel (see the module's docstring).

    Args:
        smalls: (n, S, S) uint8 grey copies (`ImageFacts.smalls`).
        small_sizes: (n, 2) their heights and widths.
        pairs: (m, 2) image indices.

    Returns:
        (m,) float32: the 99th percentile of the absolute difference of the blurred, normalised pair, compared at
        the smaller image's size; `inf` when either image is flat (one colour), which says nothing about copying.
    """
    area = small_sizes.prod(axis=1)
    pairs = np.where((area[pairs[:, 0]] > area[pairs[:, 1]])[:, None], pairs[:, ::-1], pairs)  # the smaller first
    hw = small_sizes[pairs[:, 0]]  # (m, 2) the size each pair is compared at
    key = hw[:, 0] * (SMALL + 1) + hw[:, 1]
    order = np.argsort(key, kind="stable")
    out = np.empty(len(pairs), np.float32)
    for run in np.split(order, np.flatnonzero(np.diff(key[order])) + 1) if len(pairs) else []:
        h, w = hw[run[0]]
        first, second = pairs[run, 0], pairs[run, 1]
        same = (small_sizes[second] == (h, w)).all(axis=1)
        own = np.unique(np.concatenate([first, second[same]]))  # each prepared once, however many pairs it is in
        prepared, spread = _prepared(smalls[own, :h, :w])  # (u, h, w), (u,)
        for s in range(0, len(run), block):
            a, b = np.searchsorted(own, first[s : s + block]), np.searchsorted(own, second[s : s + block])
            x, y, flat = prepared[a], np.empty_like(prepared[a]), spread[a] < FLAT
            part = same[s : s + block]
            y[part], flat[part] = prepared[b[part]], flat[part] | (spread[b[part]] < FLAT)
            if not part.all():  # the larger image of the pair is shrunk to the smaller's size
                y[~part], other = _prepared(_shrunk(smalls, small_sizes, second[s : s + block][~part], h, w))
                flat[~part] |= other < FLAT
            far = np.percentile(np.abs(x - y).reshape(len(x), -1), 99, axis=1)  # (k,)
            out[run[s : s + block]] = np.where(flat, np.inf, far)
    return out


def ink(rgb: np.ndarray) -> np.ndarray:
    """(4,) of an (h, w, 3) uint8 image: the chromaticity (R, G and B over their sum, which brightening keeps) of the
    mean of its coloured pixels (`INK`), NaN when under `MIN_INK` of them are, and their share."""
    pixels = rgb.reshape(-1, 3).astype(np.float32)  # (h * w, 3)
    coloured = pixels[pixels.max(1) - pixels.min(1) >= INK]
    share = len(coloured) / max(len(pixels), 1)
    if share < MIN_INK:
        return np.array([np.nan, np.nan, np.nan, share], np.float32)
    mean = coloured.mean(0)
    return np.append(mean / max(float(mean.sum()), 1.0), share).astype(np.float32)


def colour_distance(colours: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """(m,) how far apart the colours (`ink`) of each of `pairs` are: the L1 distance of their chromaticities; 2 (as
    far as can be) for a coloured image and a grey one, which would otherwise join a red and a green version of one
    picture through a grey copy; 0 where either has too little colour to tell."""
    a, b = colours[pairs[:, 0]], colours[pairs[:, 1]]  # (m, 4)
    apart = np.nan_to_num(np.abs(a[:, :3] - b[:, :3]).sum(1), nan=0.0)  # (m,)
    coloured_a, coloured_b = ~np.isnan(a[:, 0]), ~np.isnan(b[:, 0])
    one_grey = (coloured_a & (b[:, 3] < GREY)) | (coloured_b & (a[:, 3] < GREY))
    return np.where(one_grey, 2.0, apart)


def near_pairs(facts: ImageFacts) -> np.ndarray:
    """(m, 2) index pairs that are near-copies: a shared band, close hashes, the same pixels once blurred, and the
    same colours."""
    pairs = band_pairs(facts.hashes, MAX_HAMMING)
    pairs = pairs[pixel_distance(facts.smalls, facts.small_sizes, pairs) <= MAX_DIFF]
    return pairs[colour_distance(facts.colours, pairs) <= MAX_CHROMA]


def group_duplicates(facts: ImageFacts) -> Duplicates:
    """Group the images of `facts` into copies and near-copies (see the module's docstring)."""
    n = len(facts.paths)
    first: dict[bytes, int] = {}
    same = np.array([(first.setdefault(d, i), i) for i, d in enumerate(facts.digests)], np.int64).reshape(-1, 2)
    same = same[same[:, 0] != same[:, 1]]  # (m, 2) each copy to the first image of its pixels
    edges = np.concatenate([same, near_pairs(facts)])
    graph = coo_matrix((np.ones(len(edges)), (edges[:, 0], edges[:, 1])), shape=(n, n))
    _, component = connected_components(graph, directed=False)
    sizes = np.bincount(component, minlength=n)
    members: dict[int, list[str]] = {}
    for i in np.flatnonzero(sizes[component] > 1):
        members.setdefault(int(component[i]), []).append(facts.paths[i])
    exact = {facts.paths[i] for i in np.unique(same)}
    return Duplicates(sorted(sorted(g) for g in members.values()), exact)


def find_duplicates(paths: list[str], workers: int | None = None) -> tuple[Duplicates, ImageFacts]:
    """Decode `paths` (`image_facts`) and group their copies (`group_duplicates`)."""
    facts = image_facts(paths, workers)
    return group_duplicates(facts), facts


def without_members(items: list[tuple[str, int]], anchors: dict[str, str]) -> list[tuple[str, int]]:
    """`items` less the group members that follow an anchor (see `follow_anchors`)."""
    return [(p, y) for p, y in items if p not in anchors]


def follow_anchors(
    splits: list[list[tuple[str, int]]], members: list[tuple[str, int]], anchors: dict[str, str]
) -> list[list[tuple[str, int]]]:
    """Put each group member into the split its anchor was drawn into, so that no group straddles two splits.

    Args:
        splits: the splits (train, val, calib) drawn from the anchors and the images in no group.
        members: the (path, label) of the members left out of that draw.
        anchors: member path -> its group's anchor path (`Duplicates.anchors`).

    Returns:
        The splits with the members added, each sorted by (label, path) as the scan sorts them.
    """
    where = {p: k for k, split in enumerate(splits) for p, _ in split}
    out = [list(split) for split in splits]
    for p, y in members:
        out[where[anchors[p]]].append((p, y))
    return [sorted(split, key=lambda item: (item[1], item[0])) for split in out]
