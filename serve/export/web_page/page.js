// The page: drop or choose an image, see the top-5 and the rollout overlay. The numbers come from
// window.vitscope (vitscope.js); this file only draws them.
import { classify, ready } from "./vitscope.js";

const $ = (id) => document.getElementById(id);
const status = $("status");
const view = $("view");

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearAnswer() {
  // a new image never shows the last one's answer: everything is cleared before it is classified
  $("error").hidden = true;
  $("result").hidden = true;
  $("top").replaceChildren();
  $("answer").textContent = "";
  $("unknown-note").textContent = "";
}

function heat(v) {
  // a dark-to-yellow colour map for a value in [0, 1]
  const stops = [[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]];
  const x = Math.min(Math.max(v, 0), 1) * (stops.length - 1);
  const i = Math.min(Math.floor(x), stops.length - 2);
  const t = x - i;
  return stops[i].map((c, k) => Math.round(c + t * (stops[i + 1][k] - c)));
}

function draw(result) {
  const { width, height, rgba } = result.pixels;
  const scale = Math.max(1, Math.floor(288 / Math.max(width, height)));
  view.width = width * scale;
  view.height = height * scale;
  const ctx = view.getContext("2d");
  const image = new OffscreenCanvas(width, height);
  image.getContext("2d").putImageData(rgba, 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(image, 0, 0, view.width, view.height);
  const [gh, gw] = result.rollout.grid;
  const map = new ImageData(gw, gh);
  result.rollout.values.forEach((v, i) => {
    const [r, g, b] = heat(v);
    map.data.set([r, g, b, Math.round(40 + 150 * v)], i * 4); // the image shows through where the map is low
  });
  const overlay = new OffscreenCanvas(gw, gh);
  overlay.getContext("2d").putImageData(map, 0, 0);
  ctx.imageSmoothingEnabled = true;
  ctx.drawImage(overlay, 0, 0, view.width, view.height);
}

function show(result) {
  const best = result.top[0];
  $("answer").textContent = `${best.label} (${(100 * best.score).toFixed(1)} %)`;
  $("top").replaceChildren(
    ...result.top.map(({ label, score }) => {
      const li = document.createElement("li");
      li.textContent = `${label}: ${(100 * score).toFixed(1)} %`;
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${Math.round(120 * score)}px`;
      li.append(bar);
      return li;
    }),
  );
  $("scores-note").textContent = result.calibrated
    ? "Calibrated probabilities: of the images given a score, about that share are right."
    : "Softmax scores: this file carries no calibration.";
  $("unknown-note").textContent = result.unknown
    ? `Unknown: this image looks unlike the training images, so it is not one of the ${result.labels.length} ` +
      "classes this model knows; the top class is only the least bad."
    : "";
  draw(result);
  $("result").hidden = false;
}

async function run(file) {
  clearAnswer();
  status.textContent = `Classifying ${file.name}…`;
  try {
    const result = await classify(file);
    show(result);
    status.textContent = `${file.name}: done.`;
  } catch (e) {
    showError(e.message || String(e));
    status.textContent = `${file.name}: failed.`;
  }
}

const drop = $("drop");
drop.addEventListener("dragover", (e) => {
  e.preventDefault();
  drop.classList.add("over");
});
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  const file = e.dataTransfer.files[0];
  if (file) run(file);
});
$("file").addEventListener("change", (e) => {
  const file = e.target.files[0];
  if (file) run(file);
  e.target.value = ""; // choosing the same file again classifies it again
});

ready.then(
  (metadata) => {
    const names = metadata.class_names;
    $("title").textContent = `vitscope: ${metadata.variant || "ViT"}`;
    const [h, w] = metadata.input_size;
    status.textContent = `Ready: ${names.length} classes (${names.slice(0, 4).join(", ")}${names.length > 4 ? ", …" : ""}), ${w} x ${h} input.`;
    document.body.dataset.ready = "true";
  },
  (e) => {
    status.textContent = "The model did not load.";
    showError(e.message || String(e));
  },
);
