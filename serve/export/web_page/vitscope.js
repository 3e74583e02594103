// vitscope in the browser: the exported file classified and explained on this page, with no server.
//
//   await window.vitscope.ready                  // resolves with the model's metadata once it is loaded
//   await window.vitscope.classify(urlOrBlob)    // {labels, logits, probs, top: [{label, score}],
//                                                //  rollout: {grid: [Gh, Gw], values}, timings, pixels}
//
// Everything the page needs is read from model.onnx itself: its class names, input size and
// preprocessing come from the file's metadata_props (the same entries OnnxClassifier reads), so another
// export dropped in its place works unchanged. The graph is the portable target: (1, H, W, 3) uint8
// pixels in, normalisation inside, `logits` (1, K) and `attns` (depth, 1, nh, N, N) out.
import * as ort from "./ort/ort.wasm.min.mjs";

const MODEL_URL = new URL("./model.onnx", import.meta.url);
const MAX_PIXELS = 40_000_000; // the runtime's limit (serve.runtime.images.DEFAULT_MAX_PIXELS)

ort.env.wasm.wasmPaths = new URL("./ort/", import.meta.url).href;
// WASM threads need SharedArrayBuffer, which browsers give only to cross-origin isolated pages (a host that
// sends COOP and COEP headers); elsewhere one thread, which onnxruntime-web would fall back to anyway.
ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;

// --- the file's metadata: ModelProto field 14, metadata_props, read from the protobuf wire format ---------

function readVarint(bytes, pos) {
  let value = 0;
  let scale = 1;
  for (;;) {
    if (pos >= bytes.length) throw new Error("model.onnx is truncated (a varint runs past the end)");
    const b = bytes[pos++];
    value += (b & 0x7f) * scale; // arithmetic, not bit shifts: lengths may pass 2^31
    if (b < 0x80) return [value, pos];
    scale *= 128;
  }
}

function fields(bytes, start, end, visit) {
  // each top-level field of one message: visit(number, wireType, valueStart, valueEnd)
  let pos = start;
  while (pos < end) {
    let key;
    [key, pos] = readVarint(bytes, pos);
    const number = Math.floor(key / 8);
    const wire = key % 8;
    let valueEnd;
    if (wire === 0) [, valueEnd] = readVarint(bytes, pos);
    else if (wire === 1) valueEnd = pos + 8;
    else if (wire === 5) valueEnd = pos + 4;
    else if (wire === 2) {
      let length;
      [length, pos] = readVarint(bytes, pos);
      valueEnd = pos + length;
    } else throw new Error(`model.onnx is not an ONNX file (protobuf wire type ${wire})`);
    if (valueEnd > end) throw new Error("model.onnx is truncated: copy the whole file again");
    visit(number, wire, pos, valueEnd);
    pos = valueEnd;
  }
}

function parseValue(text) {
  // as the runtime reads them: JSON where it parses, else the string itself
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

export function readMetadata(bytes) {
  const utf8 = new TextDecoder();
  const metadata = {};
  fields(bytes, 0, bytes.length, (number, wire, start, end) => {
    if (number !== 14 || wire !== 2) return; // metadata_props: StringStringEntryProto {key = 1, value = 2}
    let key = "";
    let value = "";
    fields(bytes, start, end, (n, w, s, e) => {
      if (w !== 2) return;
      if (n === 1) key = utf8.decode(bytes.subarray(s, e));
      if (n === 2) value = utf8.decode(bytes.subarray(s, e));
    });
    metadata[key] = parseValue(value);
  });
  if (metadata.vitscope_format !== 1) {
    throw new Error("model.onnx has no vitscope metadata (class names, preprocessing): write the folder with vit-export --web");
  }
  return metadata;
}

// --- preprocessing: Preprocess.to_uint8, with Pillow's own resampling ------------------------------------
//
// A canvas resizes with the browser's filter, which gives other pixels than Pillow's, and so other logits.
// The resampling here is Pillow's (ImagingResample, libImaging/Resample.c) step for step: separable, the
// horizontal pass first, the filter widened by the scale when shrinking, coefficients in 22-bit fixed
// point, each pass rounded and clipped to 8 bits. With it the page feeds the graph the very pixels that
// OnnxClassifier.prepare does, for any size of image (the image is resampled at full resolution, as
// `prepare` does; the server and vit-predict first reduce very large ones, `load_reduced`).

const FILTERS = {
  bicubic: [2, (x) => {
    const a = -0.5;
    x = Math.abs(x);
    if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
    if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
    return 0;
  }],
  bilinear: [1, (x) => Math.max(0, 1 - Math.abs(x))],
  lanczos: [3, (x) => (x >= -3 && x < 3 ? sinc(x) * sinc(x / 3) : 0)],
};
const PRECISION_BITS = 22;

function sinc(x) {
  if (x === 0) return 1;
  x *= Math.PI;
  return Math.sin(x) / x;
}

function coefficients(inSize, in0, in1, outSize, [support0, filter]) {
  // Pillow's precompute_coeffs: for each output index, the first input index, how many, and their fixed-point
  // weights; [in0, in1) is the part of the input resampled (the box, float32 as Pillow holds it)
  const scale = Math.fround(in1 - in0) / outSize;
  const filterscale = Math.max(scale, 1);
  const invFilterscale = 1 / filterscale;
  const support = support0 * filterscale;
  const ksize = Math.ceil(support) * 2 + 1;
  const bounds = new Int32Array(outSize * 2);
  const kk = new Int32Array(outSize * ksize);
  const w = new Float64Array(ksize);
  for (let xx = 0; xx < outSize; xx++) {
    const center = in0 + (xx + 0.5) * scale;
    const xmin = Math.max(0, Math.trunc(center - support + 0.5));
    const n = Math.min(inSize, Math.trunc(center + support + 0.5)) - xmin;
    let ww = 0;
    for (let x = 0; x < n; x++) {
      w[x] = filter((x + xmin - center + 0.5) * invFilterscale);
      ww += w[x];
    }
    for (let x = 0; x < n; x++) {
      const k = ww !== 0 ? w[x] / ww : w[x];
      kk[xx * ksize + x] = Math.trunc(k < 0 ? -0.5 + k * 2 ** PRECISION_BITS : 0.5 + k * 2 ** PRECISION_BITS);
    }
    bounds[xx * 2] = xmin;
    bounds[xx * 2 + 1] = n;
  }
  return { bounds, kk, ksize };
}

function clip8(ss) {
  return Math.min(255, Math.max(0, Math.floor(ss / 2 ** PRECISION_BITS)));
}

function resamplePass(src, w, h, outSize, { bounds, kk, ksize }, horizontal) {
  // one pass over an RGB image (3 bytes a pixel): along x (horizontal) or along y, with `coefficients`
  const [ow, oh] = horizontal ? [outSize, h] : [w, outSize];
  const out = new Uint8Array(ow * oh * 3);
  const half = 2 ** (PRECISION_BITS - 1);
  for (let y = 0; y < oh; y++) {
    for (let x = 0; x < ow; x++) {
      const i = horizontal ? x : y;
      const start = bounds[i * 2];
      const n = bounds[i * 2 + 1];
      let s0 = half, s1 = half, s2 = half;
      for (let t = 0; t < n; t++) {
        const k = kk[i * ksize + t];
        const p = horizontal ? (y * w + start + t) * 3 : ((start + t) * w + x) * 3;
        s0 += src[p] * k;
        s1 += src[p + 1] * k;
        s2 += src[p + 2] * k;
      }
      const o = (y * ow + x) * 3;
      out[o] = clip8(s0);
      out[o + 1] = clip8(s1);
      out[o + 2] = clip8(s2);
    }
  }
  return out;
}

function nearest(src, w, h, newW, newH, [x0, y0, x1, y1]) {
  // Pillow's NEAREST resize is an affine scale (ImagingScaleAffine): the source position of each output
  // pixel's centre, stepped by the scale, truncated
  const out = new Uint8Array(newW * newH * 3);
  const ax = Math.fround(x1 - x0) / newW;
  const ay = Math.fround(y1 - y0) / newH;
  const xin = new Int32Array(newW);
  for (let x = 0, xo = x0 + ax * 0.5; x < newW; x++, xo += ax) xin[x] = Math.min(w - 1, Math.trunc(xo));
  for (let y = 0, yo = y0 + ay * 0.5; y < newH; y++, yo += ay) {
    const sy = Math.min(h - 1, Math.trunc(yo));
    for (let x = 0; x < newW; x++) out.set(src.subarray((sy * w + xin[x]) * 3, (sy * w + xin[x]) * 3 + 3), (y * newW + x) * 3);
  }
  return out;
}

function resample(src, w, h, newW, newH, interpolation, box) {
  // Pillow's resize in C (_imaging.c): the box as 32-bit floats; a whole-pixel box of the output's size is a crop,
  // NEAREST an affine scale, the other filters ImagingResample (only the rows the box needs are resampled)
  const [x0, y0, x1, y1] = box.map(Math.fround);
  if (Number.isInteger(x0) && Number.isInteger(y0) && x1 - x0 === newW && y1 - y0 === newH) {
    const out = new Uint8Array(newW * newH * 3);
    for (let y = 0; y < newH; y++) out.set(src.subarray(((y + y0) * w + x0) * 3, ((y + y0) * w + x0 + newW) * 3), y * newW * 3);
    return out;
  }
  if (interpolation === "nearest") return nearest(src, w, h, newW, newH, [x0, y0, x1, y1]);
  const filter = FILTERS[interpolation];
  if (!filter) throw new Error(`the model's preprocessing asks for ${interpolation} resampling, which this page lacks`);
  const vertical = coefficients(h, y0, y1, newH, filter);
  let out = src;
  let rows = h;
  if (newW !== w || x0 !== 0 || x1 !== newW) {
    // the rows the vertical pass reads, and only those, resampled along x first
    const first = vertical.bounds[0];
    rows = vertical.bounds[newH * 2 - 2] + vertical.bounds[newH * 2 - 1] - first;
    for (let i = 0; i < newH; i++) vertical.bounds[i * 2] -= first;
    const horizontal = coefficients(w, x0, x1, newW, filter);
    out = resamplePass(src.subarray(first * w * 3, (first + rows) * w * 3), w, rows, newW, horizontal, true);
  }
  if (newH !== h || y0 !== 0 || y1 !== newH) out = resamplePass(out, newW, rows, newH, vertical, false);
  return out;
}

export function resize(src, w, h, newW, newH, interpolation = "bicubic", box = [0, 0, w, h]) {
  // Image.resize((newW, newH), interpolation, box) of an RGB image held as (h, w, 3) bytes: only the box's part of
  // the image is resampled
  if (newW === w && newH === h && box[0] === 0 && box[1] === 0 && box[2] === w && box[3] === h) return src;
  if (h > w * 100 && newH < h) {
    // Pillow (12.2 on) shrinks an image over 100 times taller than wide along y first, then along x
    const tall = resample(src, w, h, w, newH, interpolation, [0, box[1], w, box[3]]);
    return resample(tall, w, newH, newW, newH, interpolation, [box[0], 0, box[2], newH]);
  }
  return resample(src, w, h, newW, newH, interpolation, box);
}

export function resizeCrop(w, h, preprocess) {
  // Preprocess.resize_crop's geometry: the size that covers img_size / crop_pct (aspect kept), a centred crop, and
  // that crop in the source image (the box, the only part resampled)
  const [H, W] = preprocess.img_size;
  const crop = preprocess.crop_pct;
  const scale = Math.max(H / crop / h, W / crop / w);
  const newW = Math.max(W, Math.floor(w * scale + 0.5));
  const newH = Math.max(H, Math.floor(h * scale + 0.5));
  const left = Math.floor((newW - W) / 2);
  const top = Math.floor((newH - H) / 2);
  const sx = w / newW;
  const sy = h / newH;
  return { newW, newH, left, top, W, H, box: [left * sx, top * sy, (left + W) * sx, (top + H) * sy] };
}

// The image's size from its first bytes, as Pillow reads it on the server: PNG, JPEG, GIF and WebP (null for other
// kinds, whose size is checked once decoded). createImageBitmap decodes every pixel before its size can be seen
// (seconds for a 20,000 x 20,000 PNG). Reading the first bytes is part of each classify that BENCHMARKS.md times
// ("In the browser").
function reader(blob) {
  // read(at, n): n bytes of `blob` from `at` (fewer at its end), 64 KiB read at a time
  let start = 0;
  let buf = new Uint8Array(0);
  return async (at, n) => {
    if (at < start || at + n > start + buf.length) {
      start = at;
      buf = new Uint8Array(await blob.slice(at, at + Math.max(n, 1 << 16)).arrayBuffer());
    }
    return buf.subarray(at - start, at - start + n);
  };
}

async function jpegSize(read, size) {
  // the segments in turn, however long, up to a start of frame (SOF0-15 but DHT C4, JPG C8 and DAC CC), which holds
  // the size; a scan (DA) before any frame: no size
  for (let at = 2; at + 9 <= size; ) {
    const s = await read(at, 9);
    if (s[0] !== 0xff) at += 1; // a stray byte between segments, which decoders skip (libjpeg warns)
    else if (s[1] === 0xda) return null;
    else if (s[1] === 0xff) at += 1; // a fill byte before a marker
    else if (s[1] >= 0xc0 && s[1] <= 0xcf && ![0xc4, 0xc8, 0xcc].includes(s[1])) return [(s[7] << 8) | s[8], (s[5] << 8) | s[6]];
    else at += 2 + ((s[2] << 8) | s[3]);
  }
  return null;
}

async function gifSize(read, size) {
  // the logical screen, grown to the extent of the first frame (which the browser draws at its own size), found
  // past the extensions (comments, loops) before it
  const h = await read(0, 13);
  const [w, ht] = [h[6] | (h[7] << 8), h[8] | (h[9] << 8)];
  let at = 13 + (h[10] & 0x80 ? 3 << ((h[10] & 7) + 1) : 0); // past the global colour table
  while (at < size) {
    const [kind] = await read(at, 1);
    if (kind === 0x2c) {
      const d = await read(at + 1, 8); // left, top, width, height
      return [Math.max(w, (d[0] | (d[1] << 8)) + (d[4] | (d[5] << 8))), Math.max(ht, (d[2] | (d[3] << 8)) + (d[6] | (d[7] << 8)))];
    }
    if (kind !== 0x21) break; // the trailer: no frame
    at += 2; // an extension: its label, then its sub-blocks up to an empty one
    for (let n; (n = (await read(at, 1))[0]); ) at += 1 + n;
    at += 1;
  }
  return [w, ht];
}

async function headerSize(blob) {
  // [width, height] from the file's header, before any pixel is decoded; null: not a PNG, JPEG, WebP, GIF or BMP
  const read = reader(blob);
  const b = await read(0, 64);
  const v = new DataView(b.buffer, b.byteOffset, b.length);
  const ascii = (at, text) => [...text].every((c, i) => b[at + i] === c.charCodeAt(0));
  if (b.length >= 24 && b[0] === 0x89 && ascii(1, "PNG") && ascii(12, "IHDR")) return [v.getUint32(16), v.getUint32(20)];
  if (b.length >= 13 && ascii(0, "GIF8")) return gifSize(read, blob.size);
  if (b.length >= 26 && ascii(0, "BM")) {
    // BMP: the info header's width and height (negative for rows stored top-down); OS/2's old header, 16 bits each
    if (v.getUint32(14, true) === 12) return [v.getUint16(18, true), v.getUint16(20, true)];
    return [Math.abs(v.getInt32(18, true)), Math.abs(v.getInt32(22, true))];
  }
  if (b.length >= 30 && ascii(0, "RIFF") && ascii(8, "WEBP")) {
    if (ascii(12, "VP8 ")) return [v.getUint16(26, true) & 0x3fff, v.getUint16(28, true) & 0x3fff];
    if (ascii(12, "VP8L")) return [1 + (v.getUint16(21, true) & 0x3fff), 1 + ((v.getUint32(21, true) >>> 14) & 0x3fff)];
    if (ascii(12, "VP8X")) return [1 + (v.getUint32(24, true) & 0xffffff), 1 + (v.getUint32(27, true) & 0xffffff)];
    return null;
  }
  if (b.length >= 4 && b[0] === 0xff && b[1] === 0xd8) return jpegSize(read, blob.size);
  return null;
}

async function decode(source) {
  let blob = source;
  let name = source && source.name ? source.name : "the image";
  if (typeof source === "string" || source instanceof URL) {
    name = String(source);
    const response = await fetch(source);
    if (!response.ok) throw new Error(`${name} could not be fetched: HTTP ${response.status}`);
    blob = await response.blob();
  } else if (!(source instanceof Blob)) {
    throw new Error("classify takes an image URL, a Blob or a File");
  }
  if (blob.size === 0) throw new Error(`${name} is empty (0 bytes): choose the image file itself`);
  const tooLarge = (w, h) => new Error(`${name} is ${w} x ${h} pixels, over the limit of ${MAX_PIXELS.toLocaleString("en")}; resize it first`);
  const size = await headerSize(blob);
  // a file the page cannot size is not decoded: the browser would take every pixel of it before its size is known
  if (!size) throw new Error(`${name} is not a PNG, JPEG, WebP, GIF or BMP image (it may be truncated or another kind of file): try a PNG or JPEG file`);
  if (size[0] * size[1] > MAX_PIXELS) throw tooLarge(...size);
  let bitmap;
  try {
    bitmap = await createImageBitmap(blob, { imageOrientation: "from-image", premultiplyAlpha: "none", colorSpaceConversion: "none" });
  } catch {
    throw new Error(`${name} is not an image this browser can decode (it may be truncated or another kind of file): try a PNG or JPEG file`);
  }
  const [w, h] = [bitmap.width, bitmap.height];
  if (w * h > MAX_PIXELS) {
    bitmap.close();
    throw tooLarge(w, h);
  }
  return bitmap;
}

function rgbOf(bitmap) {
  // the decoded pixels as (h, w, 3) bytes; transparency composited onto white, as the runtime does
  const { width, height } = bitmap;
  const canvas = new OffscreenCanvas(width, height);
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, width, height);
  ctx.drawImage(bitmap, 0, 0); // 1:1, no resampling
  const rgba = ctx.getImageData(0, 0, width, height).data;
  const rgb = new Uint8Array(width * height * 3);
  for (let i = 0, j = 0; i < rgba.length; i += 4, j += 3) {
    rgb[j] = rgba[i];
    rgb[j + 1] = rgba[i + 1];
    rgb[j + 2] = rgba[i + 2];
  }
  return rgb;
}

export function toPixels(bitmap, preprocess) {
  // (H, W, 3) uint8 as the graph takes it, and the same crop as RGBA ImageData (for drawing what the model saw)
  const rgb = rgbOf(bitmap);
  const w = bitmap.width;
  const h = bitmap.height;
  const g = resizeCrop(w, h, preprocess);
  // as Preprocess.resize_crop: the crop alone when the image has the size already, else the box resampled
  const [src, stride, left, top] =
    g.newW === w && g.newH === h
      ? [rgb, w, g.left, g.top]
      : [resize(rgb, w, h, g.W, g.H, preprocess.interpolation, g.box), g.W, 0, 0];
  const out = new Uint8Array(g.W * g.H * 3);
  const rgba = new ImageData(g.W, g.H);
  for (let y = 0; y < g.H; y++) {
    for (let x = 0; x < g.W; x++) {
      const p = ((y + top) * stride + x + left) * 3;
      const o = y * g.W + x;
      out.set(src.subarray(p, p + 3), o * 3);
      rgba.data.set([src[p], src[p + 1], src[p + 2], 255], o * 4);
    }
  }
  return { rgb: out, rgba, width: g.W, height: g.H };
}

// --- the numbers: calibrated probabilities and attention rollout (serve.runtime.rollout) ------------------

export function softmax(logits, temperature = 1) {
  const z = Array.from(logits, (v) => v / temperature);
  const m = Math.max(...z);
  const e = z.map((v) => Math.exp(v - m));
  const s = e.reduce((a, b) => a + b, 0);
  return e.map((v) => v / s);
}

// serve.runtime.calibration.calibrated_softmax: the temperature, then (with a confidence map) the per-image
// temperature whose top-1 probability is the mapped one, by the same bisection on log(1/t).
const BISECTION_STEPS = 32;
const BRACKET = 7;

function interp(x, xs, ys) {
  if (x <= xs[0]) return ys[0];
  if (x >= xs[xs.length - 1]) return ys[ys.length - 1];
  let i = 1;
  while (xs[i] < x) i++;
  return ys[i - 1] + ((ys[i] - ys[i - 1]) * (x - xs[i - 1])) / (xs[i] - xs[i - 1]);
}

export function calibratedSoftmax(logits, calibration) {
  if (!calibration) return softmax(logits);
  const map = calibration.confidence_map;
  if (!map || map.confidence.length < 2) return softmax(logits, calibration.temperature);
  const m = Math.max(...logits);
  const d = Array.from(logits, (v) => m - v);
  const top = (logU) => 1 / d.reduce((a, di) => a + Math.exp(-di * Math.exp(logU)), 0);
  const base = -Math.log(calibration.temperature);
  const want = interp(top(base), map.confidence, map.accuracy);
  let lo = base - BRACKET;
  let hi = base + BRACKET;
  for (let i = 0; i < BISECTION_STEPS; i++) {
    const mid = (lo + hi) / 2;
    if (top(mid) < want) lo = mid;
    else hi = mid;
  }
  const u = Math.exp((lo + hi) / 2);
  return softmax(Array.from(logits, (v) => v * u));
}

// The Mahalanobis unknown-input score (serve.runtime.calibration.mahalanobis): the squared distance of the
// pre-logit features to the nearest class mean under the shared precision; null for other scores.
export function oodScore(features, calibration) {
  const ood = calibration && calibration.ood;
  if (!ood || ood.score !== "mahalanobis" || !features) return null;
  const P = ood.precision;
  let best = Infinity;
  for (const mean of ood.means) {
    const x = Array.from(features, (f, j) => f - mean[j]);
    let dist = 0;
    for (let i = 0; i < x.length; i++) {
      let row = 0;
      for (let j = 0; j < x.length; j++) row += P[i][j] * x[j];
      dist += x[i] * row;
    }
    best = Math.min(best, dist);
  }
  return best;
}

export function attentionRollout(attns, dims, numPrefixTokens, query = "cls") {
  // attns (depth, 1, nh, N, N). The runtime rolls the maps out as R = A_depth ... A_1, each A the heads'
  // mean with the residual added and rows normalised, then reads one row of R: the CLS token's ("cls") or
  // the patch rows' mean ("mean"). That row is r^T A_depth ... A_1, so it is computed here as a vector
  // times each block's matrix, last block first: depth N^2 steps, not the depth N^3 of forming R.
  const [depth, , nh, N] = dims;
  const n = numPrefixTokens;
  const L = N - n;
  let v = new Float64Array(N);
  if (query === "cls") v[0] = 1;
  else for (let i = n; i < N; i++) v[i] = 1 / L;
  const A = new Float64Array(N * N);
  for (let d = depth - 1; d >= 0; d--) {
    A.fill(0);
    const base = d * nh * N * N;
    for (let h = 0; h < nh; h++) {
      const off = base + h * N * N;
      for (let k = 0; k < N * N; k++) A[k] += attns[off + k];
    }
    const next = new Float64Array(N);
    for (let i = 0; i < N; i++) {
      if (v[i] === 0) continue;
      A[i * N + i] += nh; // the residual path: (mean + I) / 2, and the halving cancels in the normalisation
      let sum = 0;
      for (let j = 0; j < N; j++) sum += A[i * N + j];
      const w = v[i] / sum;
      for (let j = 0; j < N; j++) next[j] += w * A[i * N + j];
    }
    v = next;
  }
  const out = Array.from(v.subarray(n));
  const peak = Math.max(...out, Number.MIN_VALUE);
  return out.map((x) => x / peak);
}

// --- loading and classifying ----------------------------------------------------------------------------

async function load() {
  const response = await fetch(MODEL_URL);
  if (!response.ok) throw new Error(`model.onnx could not be fetched (HTTP ${response.status}): is it beside index.html?`);
  const bytes = new Uint8Array(await response.arrayBuffer());
  const metadata = readMetadata(bytes);
  let session;
  try {
    session = await ort.InferenceSession.create(bytes, { executionProviders: ["wasm"], graphOptimizationLevel: "all" });
  } catch (e) {
    throw new Error(`onnxruntime-web could not load model.onnx: ${e.message || e}`);
  }
  if (!session.outputNames.includes("attns")) {
    throw new Error("model.onnx outputs no attention maps: it is not the portable target; write the folder with vit-export --web");
  }
  return { session, metadata };
}

const loading = load();
let queue = Promise.resolve(); // one run at a time: a WASM session is not re-entrant

async function classifyNow(source) {
  const { session, metadata } = await loading;
  const t0 = performance.now();
  const bitmap = await decode(source);
  let pixels;
  try {
    pixels = toPixels(bitmap, metadata.preprocess);
  } finally {
    bitmap.close();
  }
  const input = new ort.Tensor("uint8", pixels.rgb, [1, pixels.height, pixels.width, 3]);
  const t1 = performance.now();
  const out = await session.run({ pixels: input });
  const t2 = performance.now();
  const logits = Array.from(out.logits.data);
  const probs = calibratedSoftmax(logits, metadata.calibration);
  const ood_score = out.features ? oodScore(out.features.data, metadata.calibration) : null;
  const unknown = ood_score === null ? null : ood_score > metadata.calibration.ood.threshold;
  const labels = metadata.class_names;
  const top = probs
    .map((score, i) => ({ label: labels[i], score }))
    .sort((a, b) => b.score - a.score)
    .slice(0, 5);
  const values = attentionRollout(out.attns.data, out.attns.dims, metadata.num_prefix_tokens, metadata.rollout_query || "cls");
  for (const t of Object.values(out)) t.dispose?.();
  const t3 = performance.now();
  return {
    timings: { decode_ms: t1 - t0, model_ms: t2 - t1, rollout_ms: t3 - t2 },
    labels,
    logits,
    probs,
    calibrated: Boolean(metadata.calibration),
    unknown,
    ood_score,
    top,
    rollout: { grid: metadata.grid_size, values },
    pixels: { width: pixels.width, height: pixels.height, rgba: pixels.rgba },
  };
}

export function classify(source) {
  const run = queue.then(() => classifyNow(source));
  queue = run.catch(() => {});
  return run;
}

export const ready = loading.then(({ metadata }) => metadata);

window.vitscope = { ready, classify, ort };
