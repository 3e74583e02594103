// vitscope in the browser: the exported file classified and explained on this page, with no server.
//
//   await window.vitscope.ready                  // resolves with the model's metadata once it is loaded
//   await window.vitscope.classify(urlOrBlob)    // {labels, logits, probs, top: [{label, score}],
//                                                //  rollout: {grid: [Gh, Gw], values}, pixels: {width, height}}
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

// --- preprocessing: Preprocess.resize_crop's geometry; the browser's own resampling -----------------------

export function resizeCrop(w, h, preprocess) {
  // the size the image is resized to (aspect kept, covering img_size / crop_pct) and the centred crop
  const [H, W] = preprocess.img_size;
  const crop = preprocess.crop_pct;
  const scale = Math.max(H / crop / h, W / crop / w);
  const newW = Math.max(W, Math.floor(w * scale + 0.5));
  const newH = Math.max(H, Math.floor(h * scale + 0.5));
  return { newW, newH, left: Math.floor((newW - W) / 2), top: Math.floor((newH - H) / 2), W, H };
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
  let bitmap;
  try {
    bitmap = await createImageBitmap(blob, { imageOrientation: "from-image", premultiplyAlpha: "none", colorSpaceConversion: "none" });
  } catch {
    throw new Error(`${name} is not an image this browser can decode (it may be truncated or another kind of file): try a PNG or JPEG file`);
  }
  if (bitmap.width * bitmap.height > MAX_PIXELS) {
    bitmap.close();
    throw new Error(`${name} is ${bitmap.width} x ${bitmap.height} pixels, over the limit of ${MAX_PIXELS.toLocaleString("en")}; resize it first`);
  }
  return bitmap;
}

export function toPixels(bitmap, preprocess) {
  // (H, W, 3) uint8 as the graph takes it, and the RGBA crop (for drawing what the model saw)
  const g = resizeCrop(bitmap.width, bitmap.height, preprocess);
  const canvas = new OffscreenCanvas(g.W, g.H);
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.fillStyle = "#fff"; // transparent images are composited onto white, as the runtime does
  ctx.fillRect(0, 0, g.W, g.H);
  ctx.imageSmoothingEnabled = true;
  ctx.imageSmoothingQuality = "high";
  ctx.drawImage(bitmap, -g.left, -g.top, g.newW, g.newH);
  const rgba = ctx.getImageData(0, 0, g.W, g.H);
  const rgb = new Uint8Array(g.W * g.H * 3);
  for (let i = 0, j = 0; i < rgba.data.length; i += 4, j += 3) {
    rgb[j] = rgba.data[i];
    rgb[j + 1] = rgba.data[i + 1];
    rgb[j + 2] = rgba.data[i + 2];
  }
  return { rgb, rgba, width: g.W, height: g.H };
}

// --- the numbers: calibrated probabilities and attention rollout (serve.runtime.rollout) ------------------

export function softmax(logits, temperature = 1) {
  const z = Array.from(logits, (v) => v / temperature);
  const m = Math.max(...z);
  const e = z.map((v) => Math.exp(v - m));
  const s = e.reduce((a, b) => a + b, 0);
  return e.map((v) => v / s);
}

export function attentionRollout(attns, dims, numPrefixTokens, query = "cls") {
  // attns (depth, 1, nh, N, N), mean over heads: R <- ((A + I) / 2, rows normalised) R, from R = I;
  // read out the CLS row (query "cls") or the mean patch row ("mean") over the patch columns, max 1
  const [depth, , nh, N] = dims;
  const n = numPrefixTokens;
  let R = new Float64Array(N * N);
  for (let i = 0; i < N; i++) R[i * N + i] = 1;
  const A = new Float64Array(N * N);
  for (let d = 0; d < depth; d++) {
    A.fill(0);
    const base = d * nh * N * N;
    for (let h = 0; h < nh; h++) {
      const off = base + h * N * N;
      for (let k = 0; k < N * N; k++) A[k] += attns[off + k] / nh;
    }
    for (let i = 0; i < N; i++) {
      A[i * N + i] += 1;
      let sum = 0;
      for (let j = 0; j < N; j++) sum += A[i * N + j];
      for (let j = 0; j < N; j++) A[i * N + j] /= sum; // (A + I) / 2 normalised: the halving cancels
    }
    const next = new Float64Array(N * N);
    for (let i = 0; i < N; i++) {
      for (let k = 0; k < N; k++) {
        const a = A[i * N + k];
        if (a === 0) continue;
        for (let j = 0; j < N; j++) next[i * N + j] += a * R[k * N + j];
      }
    }
    R = next;
  }
  const L = N - n;
  const out = new Array(L).fill(0);
  if (query === "cls") {
    for (let j = 0; j < L; j++) out[j] = R[n + j];
  } else {
    for (let i = n; i < N; i++) for (let j = 0; j < L; j++) out[j] += R[i * N + n + j] / L;
  }
  const peak = Math.max(...out, Number.MIN_VALUE);
  return out.map((v) => v / peak);
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
  const bitmap = await decode(source);
  let pixels;
  try {
    pixels = toPixels(bitmap, metadata.preprocess);
  } finally {
    bitmap.close();
  }
  const input = new ort.Tensor("uint8", pixels.rgb, [1, pixels.height, pixels.width, 3]);
  const out = await session.run({ pixels: input });
  const logits = Array.from(out.logits.data);
  const temperature = metadata.calibration ? metadata.calibration.temperature : 1;
  const probs = softmax(logits, temperature);
  const labels = metadata.class_names;
  const top = probs
    .map((score, i) => ({ label: labels[i], score }))
    .sort((a, b) => b.score - a.score)
    .slice(0, 5);
  const values = attentionRollout(out.attns.data, out.attns.dims, metadata.num_prefix_tokens, metadata.rollout_query || "cls");
  for (const t of Object.values(out)) t.dispose?.();
  return {
    labels,
    logits,
    probs,
    calibrated: Boolean(metadata.calibration),
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
