// The page to try vlserve: it calls the service's own API (the same routes, body and X-API-Key a client sends).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
const SPECIAL = new Set(["[CLS]", "[SEP]", "[MASK]", "[PAD]"]);

const TOP_LABELS = 5;  // region labels drawn: the most confident few, the highlighted one, or all (a toggle)

const state = {
  images: new Map(),  // image_id -> {url, blob (registered again from it where the service lost it), name,
                      //              size: [h, w], regions, shown (the browser decodes it), format}
  current: null,      // image_id shown
  refer: null,        // the last /refer answer (its boxes drawn whenever its image is shown)
  explain: null,      // {route, entries}
  entry: 0, head: 0, token: 0,
  uploads: new Map(), // upload id -> {id, name, source, status: waiting|reading|failed, started, node, promise,
                      //               retryIn (seconds before a 429 is sent again, or null)}
  awaited: null,      // the upload a question is about: the last one started, until the user picks another image
  highlight: null,    // region index hovered or focused (its label drawn, its box marked)
  picks: 0,           // images the user picked (a gallery button, a photo chosen): an answer asked before the
                      // latest pick does not change the image shown
};

// ---- the API ---------------------------------------------------------------------------------------------

class Problem extends Error {
  constructor(body, status) {
    super(body.detail || `HTTP ${status}`);
    this.title = body.title || `HTTP ${status}`;
    this.detail = body.detail || "";
    this.status = status;
    this.type = body.type || "";                                   // the API's problem type, as /problems/unknown-image
    this.errors = Array.isArray(body.errors) ? body.errors : [];  // a 422's: each {loc, msg, type}
    this.imageIds = Array.isArray(body.image_ids) ? body.image_ids : null;  // unknown-image's: the ids it lacks
  }
}

// A URL of this service relative to the page's own, never to the host's root: the page works at / and behind a
// proxy that serves it under a path prefix alike
const here = (path) => new URL(path.replace(/^\//, ""), document.baseURI);

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const isObject = (x) => typeof x === "object" && x !== null;

// fetch, with a network failure (the service stopped or out of reach) as a problem the page can show
async function send(url, init) {
  try {
    return await fetch(url, init);
  } catch (err) {
    throw new Problem({title: "Service unreachable", detail: "the service cannot be reached (stopped, restarting, or "
                                                              + "the network is down); try again in a moment"}, 0);
  }
}

// An answer's body: {json} where it is the JSON it says it is, else {kind}: what it is instead (a proxy's error
// page, a text, a body cut off)
async function bodyOf(response) {
  const type = (response.headers.get("content-type") || "").split(";")[0].trim().toLowerCase();
  const text = await response.text().catch(() => "");
  if (type.includes("json")) {
    try {
      return {json: JSON.parse(text)};
    } catch {
      return {kind: "JSON cut off or broken"};
    }
  }
  return {kind: type === "text/html" ? "a page" : text ? `${type || "untyped"} text` : "an empty body"};
}

// The problem an error answer states (the API's problem+json); for any other answer (another body, a 2xx that is not
// what the route answers) one the page words from the status. fromApi: what answered is an API route, so such an
// answer comes from a proxy in between or a broken service.
function problemOf(response, what, body, fromApi = true) {
  const stated = !response.ok && isObject(body.json) && (body.json.title || body.json.detail);
  if (stated) return new Problem(body.json, response.status);
  const status = `${response.status} ${response.statusText}`.trim();
  return new Problem({title: `HTTP ${status}`, detail: !fromApi ? `${what} answered ${status}`
    : `${what}: the service or a proxy answered ${response.status} with ${body.kind || "JSON of another shape"}, `
      + "not the API"}, response.status);
}

const KEY_NEEDED = "this service needs an API key: type it in the API key field at the top";
const KEY_REFUSED = "this service does not take the API key typed in the field at the top: check it";

// What a 2xx answer of each route must hold to be the API's (else a proxy's page, or a body cut off): checked before
// any of it is used, so such an answer is an error that leaves the page as it was.
const ANSWERS = {
  "/readyz": (a) => isObject(a.model) && Array.isArray(a.endpoints),
  "/images": (a, params) => typeof a.image_id === "string" && Array.isArray(a.image_size)
                            && (params.regions !== "true" || Array.isArray(a.regions)),
  "/vqa": (a) => typeof a.image_id === "string" && Array.isArray(a.answers),
  "/refer": (a) => typeof a.image_id === "string" && isObject(a.region) && Array.isArray(a.box)
                   && Array.isArray(a.runner_up),
  "/retrieve": (a) => Array.isArray(a.results),
  "/nlvr2": (a) => typeof a.answer === "boolean" && typeof a.probability === "number",
};

const RETRIES = 2;             // a request refused 429 is sent again this many times, after the Retry-After it names,
const RETRY_AFTER_MAX_S = 30;  // where that is at most this long (else the error, to retry by hand)

// One API request: its answer (of the shape ANSWERS expects), or a Problem. A 429 is sent again after its
// Retry-After (waiting(seconds) says so meanwhile, waiting(null) once it is sent again).
async function api(path, {json, form, params = {}, waiting} = {}) {
  const url = here(path);
  for (const [k, v] of Object.entries(params)) url.searchParams.set(k, v);
  const headers = {};
  const key = $("api-key").value.trim();
  if (key) headers["X-API-Key"] = key;
  let body;
  if (json !== undefined) { headers["Content-Type"] = "application/json"; body = JSON.stringify(json); }
  if (form !== undefined) body = form;
  const method = body === undefined ? "GET" : "POST";
  const what = `${method} ${path}`;
  for (let retries = 0; ; retries++) {
    const response = await send(url, {method, headers, body});
    const retryAfter = response.headers.get("retry-after");
    const wait = retryAfter === null ? NaN : Number(retryAfter);  // NaN too where it is an HTTP date
    if (response.status === 429 && retries < RETRIES && wait >= 0 && wait <= RETRY_AFTER_MAX_S) {
      if (waiting) waiting(wait);
      await sleep(wait * 1000);
      if (waiting) waiting(null);
      continue;
    }
    const answer = await bodyOf(response);
    if (response.status === 401) {
      throw new Problem({...problemOf(response, what, answer), detail: key ? KEY_REFUSED : KEY_NEEDED}, 401);
    }
    const check = ANSWERS[path];
    if (!response.ok || !isObject(answer.json) || (check && !check(answer.json, params))) {
      throw problemOf(response, what, answer);
    }
    return answer.json;
  }
}

// Each error belongs to the action that raised it (a task's form, or one upload): it stays until that action is
// repeated or the user dismisses it, whatever other requests answer meanwhile. The banner shows the latest one.
const errors = new Map();  // action -> {action: its name, title, detail}

function showError(action, name, err) {
  errors.delete(action);  // to the end: the latest
  errors.set(action, {name, title: err.title || "Error", detail: err.detail !== undefined ? err.detail : String(err)});
  renderError();
  if (err.status === 401) $("api-key").focus();  // where the fix is typed
}

function clearError(action) {
  if (errors.delete(action)) renderError();
}

function renderError() {
  const shown = [...errors.keys()].pop();
  $("error").hidden = shown === undefined;
  if (shown === undefined) return;
  const {name, title, detail} = errors.get(shown);
  $("error").dataset.action = shown;
  $("error-action").textContent = name ? `${name}: ` : "";
  $("error-title").textContent = title;
  $("error-detail").textContent = detail;
  const more = errors.size - 1;
  $("error-more").textContent = !more ? "" : more === 1 ? "1 earlier error not yet resolved: dismiss this one to read it."
    : `${more} earlier errors not yet resolved: dismiss this one to read them.`;
  $("error-more").hidden = !more;
}

function dismissError() { clearError($("error").dataset.action); }

// The requests of the tasks under way: form id -> {started, line (under its button: the seconds, a 429's wait)}
const running = new Map();

// Runs one task request from a form: its button disabled and its seconds counted meanwhile, its error shown (and
// cleared when it is asked again), timings shown. work(waiting) makes the request and shows its answer; an answer
// it cannot show is that action's error too.
async function call(action, name, button, route, work) {
  if (button) button.disabled = true;
  setBusy($(action), true);
  clearError(action);
  const task = {started: performance.now(), line: pendingLine($(action))};
  running.set(action, task);
  waitingNote(task, null);
  task.line.hidden = false;
  tick();
  try {
    const result = await work((seconds) => waitingNote(task, seconds));
    if (result && result.timings) showTimings(route, result.timings);
    return result;
  } catch (err) {
    showError(action, name, err);
    return null;
  } finally {
    if (button) button.disabled = false;
    setBusy($(action), false);
    running.delete(action);
    task.line.hidden = true;
  }
}

// The line under a form's button while its request runs: what it waits for, and the seconds (aria-hidden: the
// status is announced at each step, not each second)
function pendingLine(form) {
  let line = form.querySelector(".pending");
  if (!line) {
    line = el("p", {class: "pending hint", role: "status"}, el("span", {class: "status"}),
              el("span", {class: "elapsed", "aria-hidden": "true"}));
    line.hidden = true;
    form.querySelector("button[type=submit]").after(line);
  }
  return line;
}

function waitingNote(task, seconds) {
  task.line.querySelector(".status").textContent = seconds === null ? "Waiting for the answer…"
    : `The service is busy: asking again in ${seconds} s…`;
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

// Every photo chosen, dropped or sampled is an upload: listed (#uploads) while it waits, while its regions are found
// (the seconds counted; a first photo on a full-size detector takes seconds) and when it fails (with Retry); once
// registered it joins the gallery. Uploads run one after another: the detector is the slow part, and several at
// once would only queue on the service, or be refused 429 by a small queue.
let uploadCount = 0;
let uploadChain = Promise.resolve();

function upload(name, source) {
  const entry = {id: `upload-${++uploadCount}`, name, source};
  state.uploads.set(entry.id, entry);
  entry.node = el("li", {"data-upload": entry.id, tabindex: "-1"});  // focusable: it keeps focus after Retry
  $("uploads").append(entry.node);
  state.awaited = entry;
  state.picks++;
  queueUpload(entry);
  return entry.promise;
}

function queueUpload(entry) {
  entry.status = "waiting";
  entry.retryIn = null;
  clearError(entry.id);  // repeated: its error goes (and comes back if it fails again)
  renderUpload(entry);
  entry.promise = uploadChain = uploadChain.then(() => runUpload(entry));
}

// The registered image_id, or null where it failed (its error shown, its entry kept to retry).
async function runUpload(entry) {
  if (!state.uploads.has(entry.id)) return null;  // removed meanwhile
  entry.status = "reading";
  entry.started = performance.now();
  renderUpload(entry);
  try {
    const blob = await entry.source();
    const form = new FormData();
    form.append("file", blob, entry.name);
    const waiting = (seconds) => { entry.retryIn = seconds; renderUpload(entry); };
    const result = await api("/images", {form, params: {regions: "true", timings: "true"}, waiting});
    if (!state.images.has(result.image_id)) {
      const url = URL.createObjectURL(blob);
      state.images.set(result.image_id, {url, blob, name: entry.name, size: result.image_size, regions: result.regions,
                                         shown: await decodes(url), format: formatOf(blob, entry.name)});
    }
    if (result.timings) showTimings("POST /images", result.timings);
    const show = state.awaited === entry || !state.current;  // not where the user has picked another image since
    const focused = entry.node.contains(document.activeElement);
    removeUpload(entry);
    refreshGallery();
    if (show) select(result.image_id);
    if (focused) galleryButton(result.image_id).focus();  // its line is gone: focus goes to the image it became
    return result.image_id;
  } catch (err) {
    entry.status = "failed";
    entry.problem = err;
    renderUpload(entry);
    showError(entry.id, entry.name, err);
    return null;
  }
}

function removeUpload(entry) {
  state.uploads.delete(entry.id);
  entry.node.remove();
  clearError(entry.id);
  if (state.awaited === entry) state.awaited = null;
  renderBusy();
}

// Where focus goes when the user removes an upload's line: the same button on the next line (or the one before),
// else the file chooser
function focusAfterRemoving(entry) {
  const lines = [...$("uploads").children];
  const at = lines.indexOf(entry.node);
  const neighbour = lines[at + 1] || lines[at - 1];
  return (neighbour && (neighbour.querySelector("button.remove") || neighbour)) || $("file");
}

function renderUpload(entry) {
  const node = entry.node;
  const focused = node.contains(document.activeElement);  // its Retry pressed, or the line itself focused since
  node.className = entry.status;
  setBusy(node, entry.status !== "failed");
  if (entry.status === "failed") {
    const retry = el("button", {type: "button", class: "retry", text: "Retry"});
    retry.addEventListener("click", () => { state.awaited = entry; queueUpload(entry); });
    const remove = el("button", {type: "button", class: "remove", "aria-label": `Remove ${entry.name}`, text: "×"});
    remove.addEventListener("click", () => {
      const next = focusAfterRemoving(entry);
      removeUpload(entry);
      next.focus();
    });
    const why = entry.problem.title || entry.problem.message || "failed";
    node.replaceChildren(el("span", {class: "name", text: entry.name}),
                         el("span", {class: "status", text: ` not registered: ${why}`}), retry, remove);
    if (focused) retry.focus();
  } else {
    const status = entry.status === "waiting" ? " waiting for the photo before it…"
      : entry.retryIn !== null ? ` the service is busy: trying again in ${entry.retryIn} s…` : " finding regions…";
    node.replaceChildren(el("span", {class: "name", text: entry.name}), el("span", {class: "status", text: status}),
                         el("span", {class: "elapsed", "aria-hidden": "true"}));
    if (focused) node.focus();  // its buttons are gone while it runs: the line keeps focus
  }
  renderBusy();
  tick();
}

// The seconds each photo has been read for, and each task's request has run; aria-hidden, so the live regions
// announce each step, not each second.
function tick() {
  const since = (started) => ` ${Math.floor((performance.now() - started) / 1000)} s`;
  for (const entry of state.uploads.values()) {
    const elapsed = entry.node.querySelector(".elapsed");
    if (elapsed && entry.status === "reading") elapsed.textContent = since(entry.started);
  }
  for (const task of running.values()) task.line.querySelector(".elapsed").textContent = since(task.started);
}

function setBusy(node, busy) {
  if (busy) node.setAttribute("aria-busy", "true"); else node.removeAttribute("aria-busy");
}

function renderBusy() {
  const busy = [...state.uploads.values()].some((entry) => entry.status !== "failed");
  setBusy($("gallery"), busy);
  $("drop").classList.toggle("busy", busy);
}

async function fileSource(file) { return file; }

function sampleSource(name) {
  return async () => {
    const url = here(`page/${name}`);
    const response = await send(url);
    if (!response.ok) throw problemOf(response, `GET ${url.pathname}`, await bodyOf(response), false);
    return response.blob();
  };
}

// Whether this browser can show the image (none shows TIFF): else a blank frame of its size carries the regions.
function decodes(url) {
  const image = new Image();
  image.src = url;
  return image.decode().then(() => true, () => false);
}

function formatOf(blob, name) {
  const type = (blob.type || "").replace(/^image\//, "");
  const extension = name.includes(".") ? name.split(".").pop() : "";
  return (type || extension || "this").toUpperCase();
}

function thumbnail(image) {
  return image.shown ? el("img", {src: image.url, alt: ""})
                     : el("span", {class: "no-thumb", "aria-hidden": "true", text: image.format});
}

// Replaces a container's children; where focus was on one of them, it goes to the new child of the same key (a
// data attribute): a list rebuilt under the keyboard must not send focus back to the start of the page.
function replaceKeepingFocus(container, key, children) {
  const active = document.activeElement;
  const kept = active && active !== container && container.contains(active) ? active.dataset[key] : undefined;
  container.replaceChildren(...children);
  const same = kept === undefined ? null : children.find((child) => child.dataset[key] === kept);
  if (same) same.focus();
}

const galleryButton = (imageId) => [...$("gallery").children].find((button) => button.dataset.imageId === imageId);

function refreshGallery() {
  const buttons = [];
  const options = [];
  for (const [id, image] of state.images) {
    const button = el("button", {type: "button", "aria-pressed": String(id === state.current), "data-image-id": id,
                                 "aria-label": `Show ${image.name} (${shortId(id)})`},
                      thumbnail(image), el("span", {text: shortId(id)}));
    button.addEventListener("click", () => { state.awaited = null; state.picks++; select(id); });
    buttons.push(button);
    options.push([id, `${image.name} · ${shortId(id)}`]);
  }
  replaceKeepingFocus($("gallery"), "imageId", buttons);
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
  if (state.current !== imageId) state.highlight = null;
  state.current = imageId;
  const image = state.images.get(imageId);
  const [h, w] = image.size;
  $("stage").hidden = false;
  // the frame has the image's shape from its image_size, whether the browser can show the image or not (and its
  // width from that shape where a tall image would be taller than the screen: style.css)
  $("frame").style.aspectRatio = `${w} / ${h}`;
  $("frame").style.setProperty("--aspect", String(w / h));
  $("frame").classList.toggle("blank", !image.shown);
  const picture = $("picture");
  picture.hidden = !image.shown;
  if (image.shown) picture.src = image.url; else picture.removeAttribute("src");
  picture.alt = `${image.name}, ${w} by ${h} pixels`;
  picture.dataset.imageId = imageId;
  $("no-display").hidden = image.shown;
  $("no-display").textContent = image.shown ? "" : `This browser cannot display ${image.format} images: the regions ` +
    `are drawn on a blank frame of the image's size (${w} × ${h} pixels); every task works as usual.`;
  $("overlay").setAttribute("viewBox", `0 0 ${w} ${h}`);
  $("caption").textContent = `${image.name} · image_id ${imageId} · ${image.regions.length} regions`;
  for (const button of $("gallery").children) button.setAttribute("aria-pressed", String(button.dataset.imageId === imageId));
  $("region-list").replaceChildren(...image.regions.map((r) => {
    const item = el("li", {tabindex: "0", "data-index": r.index,
      text: `${r.label} ${fmt(r.score, 2)}, ${r.attribute} ${fmt(r.attribute_score, 2)} · box ${r.box.map((v) => Math.round(v)).join(", ")}`});
    for (const on of ["mouseenter", "focus"]) item.addEventListener(on, () => highlight(r.index));
    for (const off of ["mouseleave", "blur"]) item.addEventListener(off, () => highlight(null));
    return item;
  }));
  noteOtherImage();
  draw();
}

// ---- drawing over the image -------------------------------------------------------------------------------

// Image pixels per screen pixel: lines and labels keep one size on screen whatever the image's resolution.
function unit() {
  const shown = $("frame").getBoundingClientRect().width;
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
    // every box, the largest first (a smaller one on top stays within reach of the pointer); labels only for the
    // regions labelled() names, the highlighted one last (on top)
    const named = labelled(image);
    const area = (r) => (r.box[2] - r.box[0]) * (r.box[3] - r.box[1]);
    for (const r of [...image.regions].sort((a, b) => area(b) - area(a))) {
      const marked = r.index === state.highlight;
      regions.append(boxRect(r.box, marked ? "region highlighted" : "region", {"data-index": r.index,
                                                                              ...(marked ? {"stroke-width": stroke() * 2} : {})}));
    }
    const texts = [...image.regions].sort((a, b) => b.score - a.score)
      .filter((r) => named.has(r.index) && r.index !== state.highlight).map((r) => regionLabel(r));
    regions.append(...texts);
    const marked = image.regions.find((r) => r.index === state.highlight);
    if (marked) regions.append(regionLabel(marked, " highlighted"));
    for (const text of regions.querySelectorAll("text")) keepInside(text, image.size);
    if (!$("all-labels").checked) spread(texts, image.size[0]);  // a few labels: none over another
  }
  const some = image.regions.length > TOP_LABELS && !$("all-labels").checked;
  $("labels-hint").hidden = !some || !$("show-regions").checked;
  $("labels-hint").textContent = `Labels of the ${TOP_LABELS} most confident of ${image.regions.length} regions; ` +
    "point at a box, or at a line of the region list, for its label.";
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
  for (const text of [...attention.querySelectorAll("text"), ...refer.querySelectorAll("text")]) keepInside(text, image.size);
}

function regionLabel(r, extra = "") {
  return label(r.box, `${r.index} ${r.label} ${fmt(r.score, 2)} · ${r.attribute}`, `region-label${extra}`, true);
}

// The regions whose labels are drawn: all of them (the toggle, or a few regions), else the TOP_LABELS most
// confident; the highlighted one is drawn besides.
function labelled(image) {
  const byScore = [...image.regions].sort((a, b) => b.score - a.score);
  return new Set(($("all-labels").checked ? byScore : byScore.slice(0, TOP_LABELS)).map((r) => r.index));
}

function highlight(index) {
  if (state.highlight === index) return;
  state.highlight = index;
  for (const item of $("region-list").children) item.classList.toggle("highlighted", Number(item.dataset.index) === index);
  draw();
}

// Labels (most confident first) moved down, each below those it would cover, while the image has room.
function spread(texts, height) {
  const placed = [];
  const over = (a, b) => a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height;
  for (const text of texts) {
    let box = text.getBBox();
    for (let moves = 0; moves <= placed.length; moves++) {
      const under = placed.find((other) => over(box, other));
      if (!under) break;
      const dy = under.y + under.height - box.y;
      if (box.y + box.height + dy > height) break;  // no room below: it stays where it is
      text.setAttribute("y", Number(text.getAttribute("y")) + dy);
      box = text.getBBox();
    }
    placed.push(box);
  }
}

// A label moved back inside the image where it would run past an edge (the frame clips what is outside).
function keepInside(text, [h, w]) {
  const box = text.getBBox();
  if (!box.width) return;  // not laid out (the stage hidden)
  const dx = box.x < 0 ? -box.x : Math.min(0, w - (box.x + box.width));
  const dy = box.y < 0 ? -box.y : Math.min(0, h - (box.y + box.height));
  if (dx) text.setAttribute("x", Number(text.getAttribute("x")) + dx);
  if (dy) text.setAttribute("y", Number(text.getAttribute("y")) + dy);
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

// follow: the entry's image is shown (not where the user picked another image while the request ran)
function setExplain(route, entries, follow) {
  if (!entries || !entries.length) return;
  state.explain = {route, entries};
  state.entry = 0; state.head = 0;
  const entry = entries[0];
  state.token = Math.max(0, entry.tokens.findIndex((t) => !SPECIAL.has(t)));
  $("explain-controls").hidden = false;
  $("explain-image").replaceChildren(...entries.map((e, i) => el("option", {value: i,
    text: `${entries.length === 2 && route === "/nlvr2" ? (i ? "right" : "left") + " · " : ""}${shortId(e.image_id)}`})));
  $("explain-image").disabled = entries.length < 2;
  renderExplain(follow);
}

// follow: show the explained entry's image (a word, a head or an image of the explanation picked; an answer that
// may change the image shown)
function renderExplain(follow = true) {
  const entry = explainedEntry();
  if (!entry) return;
  if (follow && state.images.has(entry.image_id) && state.current !== entry.image_id) select(entry.image_id);
  $("explain-about").textContent = `${state.explain.route}: "${entry.text}" over image ${shortId(entry.image_id)}, ` +
    `${entry.layers} ${entry.layer_kind}s × ${entry.heads_per_layer} heads; heads ` +
    (entry.ranked_by === "grounding" ? "ranked best first by the grounding analysis" : "in layer order") +
    `${entry.attention.length < entry.layers * entry.heads_per_layer ? ` (the first ${entry.attention.length})` : ""}.`;
  $("explain-head").replaceChildren(...entry.attention.map((a, i) => el("option", {value: i,
    text: `${i + 1}. layer ${a.layer} · head ${a.head}`})));
  $("explain-head").value = String(state.head);
  replaceKeepingFocus($("tokens"), "token", entry.tokens.map((t, i) => {
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

// The image a question is about: the one shown, or the photo being read that will be shown (waited for).
async function imageToAsk() {
  const awaited = state.awaited;
  if (awaited && state.uploads.has(awaited.id) && awaited.status !== "failed") {
    const imageId = await awaited.promise;
    if (!imageId) throw new Problem({title: "No image", detail: `${awaited.name} could not be registered (retry it, or `
                                                                 + "choose another photo)"}, 0);
    return imageId;
  }
  if (!state.current) throw new Problem({title: "No image", detail: "choose a photo or a sample image first"}, 0);
  return state.current;
}

// Every image registered, once the uploads under way are done.
async function allImages() {
  await uploadChain;
  return [...state.images.keys()];
}

const TASK_PARAMS = {timings: "true", explain: "true"};
const TASKS = {"vqa-form": ["Question", ["vqa-answers"]], "refer-form": ["Referring expression", ["refer-result", "refer-runners"]],
               "t2i-form": ["Text → images", ["t2i-results"]], "i2t-form": ["Image → texts", ["i2t-results"]],
               "nlvr2-form": ["Statement", ["nlvr2-result"]]};

// The images a task's request names
const imagesOf = (json) => [json.image_id, ...(json.image_ids || []), ...(json.images || []).map((i) => i.image_id)]
  .filter(Boolean);

const unknownImage = (err) => err.status === 404 && err.type.endsWith("unknown-image");

// A plain problem where the service lost images of a request (it restarted, or dropped them) and registering them
// again from the page did not help
function forgotten(ids, why) {
  const names = [...new Set(ids.map((id) => state.images.get(id).name))].join(", ");
  return new Problem({title: "Image unknown to the service", detail: `the service no longer holds ${names} (it `
                      + `restarted, or dropped it) and ${why}: choose the photo again`}, 404);
}

// Registers images again from the bytes the page keeps: each must come back under its image_id.
async function registerAgain(ids, waiting) {
  for (const id of ids) {
    const image = state.images.get(id);
    const form = new FormData();
    form.append("file", image.blob, image.name);
    let registered;
    try {
      registered = await api("/images", {form, waiting});
    } catch (err) {
      throw err.status === 401 ? err : forgotten([id], `registering it again failed (${err.title}: ${err.detail})`);
    }
    if (registered.image_id !== id) throw forgotten([id], "registered again it has another image_id");
  }
}

// A task's request, sent with the tasks' params. Where the service no longer knows its images (restarted, or it
// dropped them), the page registers them again and sends the request once more.
async function askTask(path, json, waiting) {
  const options = {json, params: TASK_PARAMS, waiting};
  let ids = [...new Set(imagesOf(json))].filter((id) => state.images.has(id));
  try {
    return await api(path, options);
  } catch (err) {
    if (!unknownImage(err) || !ids.length) throw err;
    if (err.imageIds) ids = ids.filter((id) => err.imageIds.includes(id));  // only those the service lacks
    if (!ids.length) throw err;
  }
  await registerAgain(ids, waiting);
  try {
    return await api(path, options);
  } catch (err) {
    throw unknownImage(err) ? forgotten(ids, "registering again did not help") : err;
  }
}

// A 422 refusing a count the page sets (top_k: every caption or image ranked; the candidates) in the user's words:
// the service states its limit there (ctx.limit), and only there.
function tooMany(err, count, things) {
  const refused = err.status === 422 && err.errors.find((e) => e.type === "limit" && Array.isArray(e.loc)
                                                             && ["top_k", "texts", "image_ids"].includes(e.loc.at(-1)));
  if (!refused) return err;
  const limit = refused.ctx && Number.isInteger(refused.ctx.limit) ? refused.ctx.limit : null;
  return new Problem({title: `Too many ${things}`,
                      detail: limit ? `at most ${limit} ${things} at once (there are ${count})`
                                    : `this service takes fewer ${things} at once than the ${count} here`}, 422);
}

// A task's request: its answer shown by show(result, follow) (follow: the image it is about may be shown: the user
// picked no other while it ran); where it fails, the answers still shown (to the request before) are marked as such.
function onSubmit(formId, route, request, show) {
  const [name, outputs] = TASKS[formId];
  $(formId).addEventListener("submit", async (event) => {
    event.preventDefault();
    const button = event.submitter || $(formId).querySelector("button[type=submit]");
    const picks = state.picks;
    const result = await call(formId, name, button, route, async (waiting) => {
      const answer = await request((path, json) => askTask(path, json, waiting));
      show(answer, state.picks === picks);
      return answer;
    });
    markStale(formId, outputs, !result);
  });
}

// A hint above a form's answers (made once): class `cls`
function noteOf(formId, cls) {
  let note = $(formId).querySelector(`.${cls}`);
  if (!note) {
    note = el("p", {class: `${cls} hint`});
    note.hidden = true;
    $(TASKS[formId][1][0]).before(note);
  }
  return note;
}

function markStale(formId, outputs, stale) {
  const shown = outputs.filter((id) => $(id).textContent.trim());
  for (const id of outputs) $(id).toggleAttribute("data-stale", stale && shown.includes(id));
  const note = noteOf(formId, "stale-note");
  note.textContent = "The request failed (the error above): the answers below are those to the request before it.";
  note.hidden = !(stale && shown.length);
}

// The image the answers of each one-image task are about: form id -> image_id. Where another image is shown, they
// are dimmed and say which image they are about.
const answeredAbout = new Map();

function noteOtherImage() {
  for (const [formId, imageId] of answeredAbout) {
    const other = imageId !== state.current;
    for (const id of TASKS[formId][1]) $(id).toggleAttribute("data-other-image", other);
    const note = noteOf(formId, "other-image-note");
    const image = state.images.get(imageId);
    note.textContent = `The answers below are about ${image ? `${image.name} · ` : "image "}${shortId(imageId)}, `
      + "not the image shown.";
    note.hidden = !other;
  }
}

function answered(formId, imageId) {
  answeredAbout.set(formId, imageId);
  noteOtherImage();
}

onSubmit("vqa-form", "POST /vqa", async (ask) => ask("/vqa", {
  image_id: await imageToAsk(), question: $("vqa-question").value, top_k: Number($("vqa-top-k").value) || 5}),
(result, follow) => {
  $("vqa-answers").replaceChildren(...result.answers.map((a) => bar(a.answer, a.score, fmt(a.score))));
  answered("vqa-form", result.image_id);
  setExplain("/vqa", result.explain, follow);
});

onSubmit("refer-form", "POST /refer", async (ask) => ask("/refer", {
  image_id: await imageToAsk(), expression: $("refer-expression").value}), (result, follow) => {
  state.refer = result;
  const image = state.images.get(result.image_id);
  const name = (r) => { const d = image && image.regions[r.index]; return d ? `region ${r.index} · ${d.label}, ${d.attribute}` : `region ${r.index}`; };
  $("refer-result").textContent = `${name(result.region)}, score ${fmt(result.score)}, box ${result.box.map((v) => Math.round(v)).join(", ")}`;
  $("refer-runners").replaceChildren(...[result.region, ...result.runner_up].map((r) => bar(name(r), r.score, fmt(r.score))));
  answered("refer-form", result.image_id);
  setExplain("/refer", result.explain, follow);
  draw();
});

onSubmit("t2i-form", "POST /retrieve", async (ask) => {
  const ids = await allImages();
  if (!ids.length) await imageToAsk();
  try {
    return await ask("/retrieve", {text: $("t2i-text").value, image_ids: ids, top_k: ids.length});
  } catch (err) {
    throw tooMany(err, ids.length, "images");
  }
}, (result, follow) => {
  // ranked by bank_score where the model has a query bank, else by score; bars: a softmax over the images shown
  const key = (hit) => (hit.bank_score !== undefined ? hit.bank_score : hit.score);
  const top = Math.max(...result.results.map(key));
  const total = result.results.reduce((sum, hit) => sum + Math.exp(key(hit) - top), 0);
  $("t2i-results").replaceChildren(...result.results.map((hit) => {
    const image = state.images.get(hit.image_id);
    return bar(`${image ? image.name : ""} · ${shortId(hit.image_id)}`, Math.exp(key(hit) - top) / total, fmt(key(hit), 2),
               image ? thumbnail(image) : null);
  }));
  setExplain("/retrieve", result.explain, follow);
});

onSubmit("i2t-form", "POST /retrieve", async (ask) => {
  const texts = $("i2t-texts").value.split("\n").map((t) => t.trim()).filter(Boolean);
  if (!texts.length) throw new Problem({title: "No caption", detail: "type at least one caption (one a line)"}, 0);
  const imageId = await imageToAsk();
  try {
    return await ask("/retrieve", {image_id: imageId, texts, top_k: texts.length});
  } catch (err) {
    throw tooMany(err, texts.length, "captions");
  }
}, (result, follow) => {
  $("i2t-results").replaceChildren(...result.results.map((hit) => bar(hit.text, hit.probability, fmt(hit.probability))));
  answered("i2t-form", result.image_id);
  setExplain("/retrieve", result.explain, follow);
});

onSubmit("nlvr2-form", "POST /nlvr2", async (ask) => {
  if (!$("nlvr2-left").value || !$("nlvr2-right").value) await allImages();  // the pair fills as photos register
  const left = $("nlvr2-left").value, right = $("nlvr2-right").value;
  if (!left || !right) await imageToAsk();
  return ask("/nlvr2", {statement: $("nlvr2-statement").value, images: [{image_id: left}, {image_id: right}]});
}, (result, follow) => {
  $("nlvr2-result").textContent = `${result.answer ? "True" : "False"} · P(true) = ${fmt(result.probability)}`;
  setExplain("/nlvr2", result.explain, follow);
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
  $("error-close").addEventListener("click", dismissError);
  $("file").addEventListener("change", () => {
    for (const file of $("file").files) upload(file.name, () => fileSource(file));
    $("file").value = "";
  });
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    for (const file of e.dataTransfer.files) upload(file.name, () => fileSource(file));  // each, one after another
  });
  for (const button of document.querySelectorAll("[data-sample]")) {
    button.addEventListener("click", () => upload(button.dataset.sample, sampleSource(button.dataset.sample)));
  }
  for (const id of ["show-regions", "show-attention", "show-refer", "all-labels"]) $(id).addEventListener("change", draw);
  $("picture").addEventListener("load", draw);
  $("picture").addEventListener("error", () => {  // decoded once, and not now: shown as the formats it cannot show
    const image = state.images.get($("picture").dataset.imageId);
    if (!image || !image.shown || !$("picture").getAttribute("src")) return;
    image.shown = false;
    refreshGallery();
    select($("picture").dataset.imageId);
  });
  const layer = $("layer-regions");
  layer.addEventListener("pointerover", (e) => { if (e.target.dataset.index !== undefined) highlight(Number(e.target.dataset.index)); });
  layer.addEventListener("pointerleave", () => highlight(null));
  setInterval(tick, 1000);
  window.addEventListener("resize", draw);
  $("explain-image").addEventListener("change", () => {
    state.entry = Number($("explain-image").value); state.head = 0; state.picks++; renderExplain();
  });
  $("explain-head").addEventListener("change", () => { state.head = Number($("explain-head").value); renderExplain(); });
  showModel();
}

init();
