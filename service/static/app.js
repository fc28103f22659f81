// The page to try vlserve: it calls the service's own API (the same routes, body and X-API-Key a client sends).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
const SPECIAL = new Set(["[CLS]", "[SEP]", "[MASK]", "[PAD]"]);

const state = {
  images: new Map(),  // image_id -> {url, name, size: [h, w], regions}
  current: null,      // image_id shown
  refer: null,        // the last /refer answer
  explain: null,      // {route, entries}
  entry: 0, head: 0, token: 0,
};

// ---- the API ---------------------------------------------------------------------------------------------

class Problem extends Error {
  constructor(body, status) {
    super(body.detail || `HTTP ${status}`);
    this.title = body.title || `HTTP ${status}`;
    this.detail = body.detail || "";
  }
}

async function api(path, {json, form, params} = {}) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params || {})) url.searchParams.set(k, v);
  const headers = {};
  const key = $("api-key").value.trim();
  if (key) headers["X-API-Key"] = key;
  let body;
  if (json !== undefined) { headers["Content-Type"] = "application/json"; body = JSON.stringify(json); }
  if (form !== undefined) body = form;
  const response = await fetch(url, {method: body === undefined ? "GET" : "POST", headers, body});
  const type = response.headers.get("content-type") || "";
  const data = type.includes("json") ? await response.json() : {detail: await response.text()};
  if (!response.ok) throw new Problem(data, response.status);
  return data;
}

function showError(err) {
  $("error-title").textContent = err.title || "Error";
  $("error-detail").textContent = err.detail !== undefined ? err.detail : String(err);
  $("error").hidden = false;
}

function clearError() { $("error").hidden = true; }

// Runs one request from a form: its button disabled meanwhile, errors shown, timings shown.
async function call(button, route, work) {
  if (button) button.disabled = true;
  try {
    const result = await work();
    clearError();
    if (result && result.timings) showTimings(route, result.timings);
    return result;
  } catch (err) {
    showError(err);
    return null;
  } finally {
    if (button) button.disabled = false;
  }
}

// ---- small DOM helpers --------------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function bar(name, value, shown, extra) {
  const fill = el("span", {class: "fill"});
  fill.style.width = `${Math.max(0, Math.min(1, value)) * 100}%`;
  const label = el("span", {class: "name"});
  if (extra) label.append(extra);
  label.append(name);
  return el("li", {}, label, el("span", {class: "track", "aria-hidden": "true"}, fill),
            el("span", {class: "value", text: shown}));
}

const fmt = (x, d = 3) => Number(x).toFixed(d);
const shortId = (id) => id.slice(0, 8);

function showTimings(route, timings) {
  $("timings-route").textContent = route;
  const body = $("timings").tBodies[0];
  body.replaceChildren();
  for (const [stage, value] of Object.entries(timings)) {
    if (stage === "cache_hit" || value === null) continue;
    body.append(el("tr", {}, el("th", {scope: "row", text: stage}), el("td", {class: "num", text: `${fmt(value, 1)} ms`})));
  }
  if (timings.cache_hit !== undefined && timings.cache_hit !== null) {
    body.append(el("tr", {}, el("th", {scope: "row", text: "regions cached"}), el("td", {text: timings.cache_hit ? "yes" : "no"})));
  }
}

// ---- images ---------------------------------------------------------------------------------------------

async function register(blob, name) {
  const form = new FormData();
  form.append("file", blob, name);
  const result = await call(null, "POST /images", () => api("/images", {form, params: {regions: "true", timings: "true"}}));
  if (!result) return;
  if (!state.images.has(result.image_id)) {
    state.images.set(result.image_id, {url: URL.createObjectURL(blob), name, size: result.image_size, regions: result.regions});
  }
  refreshGallery();
  select(result.image_id);
}

function refreshGallery() {
  const gallery = $("gallery");
  gallery.replaceChildren();
  const options = [];
  for (const [id, image] of state.images) {
    const button = el("button", {type: "button", "aria-pressed": String(id === state.current), "data-image-id": id,
                                 "aria-label": `Show ${image.name} (${shortId(id)})`},
                      el("img", {src: image.url, alt: ""}), el("span", {text: shortId(id)}));
    button.addEventListener("click", () => select(id));
    gallery.append(button);
    options.push([id, `${image.name} · ${shortId(id)}`]);
  }
  for (const [selectId, fallback] of [["nlvr2-left", 0], ["nlvr2-right", 1]]) {
    const select_ = $(selectId);
    const keep = select_.value;
    select_.replaceChildren(...options.map(([id, label]) => el("option", {value: id, text: label})));
    const ids = options.map(([id]) => id);
    select_.value = ids.includes(keep) ? keep : (ids[Math.min(fallback, ids.length - 1)] || "");
  }
  if ($("nlvr2-left").value === $("nlvr2-right").value && options.length > 1) {  // a pair of two images, first
    $("nlvr2-right").value = options.find(([id]) => id !== $("nlvr2-left").value)[0];
  }
}

function select(imageId) {
  if (!state.images.has(imageId)) return;
  if (state.current !== imageId) state.refer = null;
  state.current = imageId;
  const image = state.images.get(imageId);
  const [h, w] = image.size;
  $("stage").hidden = false;
  $("picture").src = image.url;
  $("picture").alt = `${image.name}, ${w} by ${h} pixels`;
  $("picture").dataset.imageId = imageId;
  $("overlay").setAttribute("viewBox", `0 0 ${w} ${h}`);
  $("caption").textContent = `${image.name} · image_id ${imageId} · ${image.regions.length} regions`;
  for (const button of $("gallery").children) button.setAttribute("aria-pressed", String(button.dataset.imageId === imageId));
  $("region-list").replaceChildren(...image.regions.map((r) => el("li", {
    text: `${r.label} ${fmt(r.score, 2)}, ${r.attribute} ${fmt(r.attribute_score, 2)} · box ${r.box.map((v) => Math.round(v)).join(", ")}`})));
  draw();
}

// ---- drawing over the image -------------------------------------------------------------------------------

// Image pixels per screen pixel: lines and labels keep one size on screen whatever the image's resolution.
function unit() {
  const shown = $("picture").getBoundingClientRect().width;
  const width = state.images.get(state.current).size[1];
  return shown > 0 ? width / shown : 1;
}

const stroke = () => 2 * unit();

function boxRect(box, cls, extra = {}) {
  const [x1, y1, x2, y2] = box;
  return svg("rect", {x: x1, y: y1, width: Math.max(0, x2 - x1), height: Math.max(0, y2 - y1), class: cls,
                      "stroke-width": stroke(), ...extra});
}

function label(box, text, cls, below = false) {
  const [x1, y1, x2, y2] = box;
  const right = x1 > state.images.get(state.current).size[1] / 2;  // written leftwards from the right edge: stays inside
  return svg("text", {x: right ? x2 - stroke() : x1 + stroke(), y: below ? y2 - stroke() * 2 : y1 + stroke(), class: cls,
                      "text-anchor": right ? "end" : "start", "dominant-baseline": below ? "auto" : "hanging"}, text);
}

function draw() {
  if (!state.current) return;
  const image = state.images.get(state.current);
  const regions = $("layer-regions"), attention = $("layer-attention"), refer = $("layer-refer");
  regions.replaceChildren(); attention.replaceChildren(); refer.replaceChildren();
  $("overlay").style.setProperty("--label-size", `${12 * unit()}px`);
  if ($("show-regions").checked) {
    for (const r of image.regions) {
      regions.append(boxRect(r.box, "region", {"data-index": r.index}),
                     label(r.box, `${r.index} ${r.label} ${fmt(r.score, 2)} · ${r.attribute}`, "region-label", true));
    }
  }
  const entry = explainedEntry();
  if (entry && entry.image_id === state.current && $("show-attention").checked) drawAttention(entry, attention);
  if (state.refer && state.refer.image_id === state.current && $("show-refer").checked) {
    state.refer.runner_up.forEach((r, i) => {
      refer.append(boxRect(r.box, "runner", {"data-index": r.index, "stroke-dasharray": `${5 * unit()} ${4 * unit()}`}), label(r.box, `#${i + 2} ${fmt(r.score, 2)}`, "runner-label"));
    });
    const best = state.refer.region;
    refer.append(boxRect(best.box, "chosen", {"data-index": best.index, "stroke-width": stroke() * 1.5}),
                 label(best.box, `#1 ${fmt(best.score, 2)}`, "chosen-label"));
  }
}

// ---- where the model looked ----------------------------------------------------------------------------------

function explainedEntry() {
  return state.explain ? state.explain.entries[state.entry] : null;
}

function headWeights(entry) {
  return entry.attention[state.head].weights[state.token] || [];
}

// The image dimmed except where the word looks: each region lit in proportion to its weight (relative to the
// strongest), and outlined as strongly.
function drawAttention(entry, layer) {
  const weights = headWeights(entry);
  const top = Math.max(...weights, 1e-9);
  const [h, w] = state.images.get(state.current).size;
  const mask = svg("mask", {id: "attention-mask", maskUnits: "userSpaceOnUse", x: 0, y: 0, width: w, height: h});
  mask.append(svg("rect", {x: 0, y: 0, width: w, height: h, fill: "#fff"}));
  entry.boxes.forEach((box, j) => mask.append(boxRect(box, "", {fill: "#000", "fill-opacity": fmt((weights[j] || 0) / top, 3),
                                                                 "stroke-width": 0})));
  layer.append(mask, svg("rect", {x: 0, y: 0, width: w, height: h, class: "veil", mask: "url(#attention-mask)"}));
  entry.boxes.forEach((box, j) => {
    const value = weights[j] || 0;
    layer.append(boxRect(box, "attn", {"stroke-opacity": fmt(Math.max(0.15, value / top), 3),
                                      "data-region": entry.regions[j], "data-weight": value}));
  });
  // the strongest region's weight, written on it
  const best = weights.indexOf(Math.max(...weights));
  if (best >= 0) layer.append(label(entry.boxes[best], fmt(weights[best]), "attn-label"));
}

function setExplain(route, entries) {
  if (!entries || !entries.length) return;
  state.explain = {route, entries};
  state.entry = 0; state.head = 0;
  const entry = entries[0];
  state.token = Math.max(0, entry.tokens.findIndex((t) => !SPECIAL.has(t)));
  $("explain-controls").hidden = false;
  $("explain-image").replaceChildren(...entries.map((e, i) => el("option", {value: i,
    text: `${entries.length === 2 && route === "/nlvr2" ? (i ? "right" : "left") + " · " : ""}${shortId(e.image_id)}`})));
  $("explain-image").disabled = entries.length < 2;
  renderExplain();
}

function renderExplain() {
  const entry = explainedEntry();
  if (!entry) return;
  if (state.images.has(entry.image_id) && state.current !== entry.image_id) select(entry.image_id);
  $("explain-about").textContent = `${state.explain.route}: "${entry.text}" over image ${shortId(entry.image_id)}, ` +
    `${entry.layers} ${entry.layer_kind}s × ${entry.heads_per_layer} heads; heads ` +
    (entry.ranked_by === "grounding" ? "ranked best first by the grounding analysis" : "in layer order") +
    `${entry.attention.length < entry.layers * entry.heads_per_layer ? ` (the first ${entry.attention.length})` : ""}.`;
  $("explain-head").replaceChildren(...entry.attention.map((a, i) => el("option", {value: i,
    text: `${i + 1}. layer ${a.layer} · head ${a.head}`})));
  $("explain-head").value = String(state.head);
  const tokens = $("tokens");
  tokens.replaceChildren(...entry.tokens.map((t, i) => {
    const b = el("button", {type: "button", "aria-pressed": String(i === state.token), "data-token": i, text: t});
    b.addEventListener("click", () => { state.token = i; renderExplain(); });
    return b;
  }));
  const image = state.images.get(entry.image_id);
  const weights = headWeights(entry);
  $("attention-table").tBodies[0].replaceChildren(...entry.regions.map((r, j) => {
    const region = image && image.regions[r];
    return el("tr", {}, el("td", {class: "num", text: r}), el("td", {text: region ? `${region.label} · ${region.attribute}` : ""}),
              el("td", {class: "num", text: fmt(weights[j] || 0)}));
  }));
  draw();
}

// ---- tasks ---------------------------------------------------------------------------------------------------

function needImage() {
  if (!state.current) throw new Problem({title: "No image", detail: "choose a photo or a sample image first"}, 0);
  return state.current;
}

const TASK_PARAMS = {timings: "true", explain: "true"};

function onSubmit(formId, handler) {
  $(formId).addEventListener("submit", (event) => {
    event.preventDefault();
    handler(event.submitter || $(formId).querySelector("button[type=submit]"));
  });
}

onSubmit("vqa-form", async (button) => {
  const result = await call(button, "POST /vqa", () => api("/vqa", {params: TASK_PARAMS, json: {
    image_id: needImage(), question: $("vqa-question").value, top_k: Number($("vqa-top-k").value) || 5}}));
  if (!result) return;
  $("vqa-answers").replaceChildren(...result.answers.map((a) => bar(a.answer, a.score, fmt(a.score))));
  setExplain("/vqa", result.explain);
});

onSubmit("refer-form", async (button) => {
  const result = await call(button, "POST /refer", () => api("/refer", {params: TASK_PARAMS, json: {
    image_id: needImage(), expression: $("refer-expression").value}}));
  if (!result) return;
  state.refer = result;
  const image = state.images.get(result.image_id);
  const name = (r) => { const d = image && image.regions[r.index]; return d ? `region ${r.index} · ${d.label}, ${d.attribute}` : `region ${r.index}`; };
  $("refer-result").textContent = `${name(result.region)}, score ${fmt(result.score)}, box ${result.box.map((v) => Math.round(v)).join(", ")}`;
  $("refer-runners").replaceChildren(...[result.region, ...result.runner_up].map((r) => bar(name(r), r.score, fmt(r.score))));
  setExplain("/refer", result.explain);
  draw();
});

onSubmit("t2i-form", async (button) => {
  const result = await call(button, "POST /retrieve", () => {
    const ids = [...state.images.keys()];
    if (!ids.length) needImage();
    return api("/retrieve", {params: TASK_PARAMS, json: {text: $("t2i-text").value, image_ids: ids, top_k: ids.length}});
  });
  if (!result) return;
  // ranked by bank_score where the model has a query bank, else by score; bars: a softmax over the images shown
  const key = (hit) => (hit.bank_score !== undefined ? hit.bank_score : hit.score);
  const top = Math.max(...result.results.map(key));
  const total = result.results.reduce((sum, hit) => sum + Math.exp(key(hit) - top), 0);
  $("t2i-results").replaceChildren(...result.results.map((hit) => {
    const image = state.images.get(hit.image_id);
    const thumb = image ? el("img", {src: image.url, alt: ""}) : null;
    return bar(`${image ? image.name : ""} · ${shortId(hit.image_id)}`, Math.exp(key(hit) - top) / total, fmt(key(hit), 2), thumb);
  }));
  setExplain("/retrieve", result.explain);
});

onSubmit("i2t-form", async (button) => {
  const texts = $("i2t-texts").value.split("\n").map((t) => t.trim()).filter(Boolean);
  const result = await call(button, "POST /retrieve", () => api("/retrieve", {params: TASK_PARAMS, json: {
    image_id: needImage(), texts, top_k: Math.max(1, texts.length)}}));
  if (!result) return;
  $("i2t-results").replaceChildren(...result.results.map((hit) => bar(hit.text, hit.probability, fmt(hit.probability))));
  setExplain("/retrieve", result.explain);
});

onSubmit("nlvr2-form", async (button) => {
  const result = await call(button, "POST /nlvr2", () => {
    const left = $("nlvr2-left").value, right = $("nlvr2-right").value;
    if (!left || !right) needImage();
    return api("/nlvr2", {params: TASK_PARAMS, json: {statement: $("nlvr2-statement").value,
                                                       images: [{image_id: left}, {image_id: right}]}});
  });
  if (!result) return;
  $("nlvr2-result").textContent = `${result.answer ? "True" : "False"} · P(true) = ${fmt(result.probability)}`;
  setExplain("/nlvr2", result.explain);
});

// ---- start -------------------------------------------------------------------------------------------------------

// Hides the tasks of the endpoints the model does not answer (a checkpoint without their heads: they would answer
// 404 no-head), with the controls only they use, and says which they are.
function showEndpoints(served) {
  for (const node of document.querySelectorAll("[data-endpoint]")) node.hidden = !served.includes(node.dataset.endpoint);
  const missing = [...new Set([...document.querySelectorAll(".task[hidden]")].map((form) => form.dataset.endpoint))];
  $("tasks-missing").textContent = `This model answers no ${missing.join(", ")}: its checkpoint has no such head.`;
  $("tasks-missing").hidden = !missing.length;
}

async function showModel() {
  let ready;
  try {
    ready = await api("/readyz");
  } catch (err) {
    $("model").textContent = `Not ready yet (${err.title}); retrying…`;
    setTimeout(showModel, 2000);
    return;
  }
  const m = ready.model;
  $("model").textContent = `${m.preset} ${m.size} · ${m.runtime} ${m.precision} · checkpoint ${m.checkpoint} · detector ${m.detector}`;
  showEndpoints(ready.endpoints);
}

function init() {
  const key = sessionStorage.getItem("vlserve-api-key");
  if (key) $("api-key").value = key;
  $("api-key").addEventListener("change", () => sessionStorage.setItem("vlserve-api-key", $("api-key").value));
  $("error-close").addEventListener("click", clearError);
  $("file").addEventListener("change", () => {
    const file = $("file").files[0];
    if (file) register(file, file.name);
    $("file").value = "";
  });
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    const file = e.dataTransfer.files[0];
    if (file) register(file, file.name);
  });
  for (const button of document.querySelectorAll("[data-sample]")) {
    button.addEventListener("click", async () => {
      const name = button.dataset.sample;
      const response = await fetch(`/page/${name}`);
      register(await response.blob(), name);
    });
  }
  for (const id of ["show-regions", "show-attention", "show-refer"]) $(id).addEventListener("change", draw);
  $("picture").addEventListener("load", draw);  // its size on screen is known once it has loaded
  window.addEventListener("resize", draw);
  $("explain-image").addEventListener("change", () => { state.entry = Number($("explain-image").value); state.head = 0; renderExplain(); });
  $("explain-head").addEventListener("change", () => { state.head = Number($("explain-head").value); renderExplain(); });
  showModel();
}

init();
