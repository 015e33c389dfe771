// One slide, zoomable from the thumbnail (zoom 0) to level 0 (zoom max_zoom: 1 screen px = 1 level-0 px), with
// overlay tile layers and GeoJSON layers, each with a toggle and an opacity slider, and the tile under a click.
"use strict";
const sid = decodeURIComponent(location.pathname.split("/")[2]);
const enc = encodeURIComponent(sid);
window.viewer = {ready: false, error: null};

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function layerRow(name, label, layer, map, initialOpacity, setOpacity) {
  const row = el("div", {class: "layer"});
  const box = el("input", {type: "checkbox", id: "toggle-" + name});
  const lab = el("label", {for: "toggle-" + name}, " " + label + " ");
  const range = el("input", {type: "range", min: "0", max: "100", value: String(Math.round(initialOpacity * 100)), id: "opacity-" + name});
  box.addEventListener("change", () => { if (box.checked) layer.addTo(map); else map.removeLayer(layer); });
  range.addEventListener("input", () => setOpacity(Number(range.value) / 100));
  row.append(box, lab, range);
  document.getElementById("layers").appendChild(row);
}

function showTile(t) {
  const info = document.getElementById("info");
  info.replaceChildren();
  if (!t) { info.textContent = "no tile here"; return; }
  const table = el("table", {id: "tile-info"});
  for (const [k, v] of Object.entries(t)) {
    const tr = el("tr");
    tr.append(el("td", {}, k), el("td", {}, Array.isArray(v) ? (v.join(", ") || "none") : String(v)));
    table.appendChild(tr);
  }
  info.appendChild(table);
  if (t.position !== undefined) info.prepend(el("p", {}, "attention rank " + t.position + " of " + t.n_scored));
  const size = Math.min(Math.round(t.size), 1024);
  const img = el("img", {id: "crop", alt: "full-resolution crop", src: "/crop/" + enc + "?x=" + t.x + "&y=" + t.y + "&size=" + size});
  info.appendChild(img);
}

function init(info) {
  document.getElementById("title").textContent = sid;
  document.title = sid + " - wsi-pipeline view";
  const r = info.row;
  const meta = [];
  for (const k of ["label", "split", "pred", "prob", "risk"]) if (r[k] !== null && r[k] !== undefined) meta.push(k + " " + r[k]);
  if (info.error) {
    const e = document.getElementById("error");
    e.hidden = false;
    e.textContent = "This slide cannot be opened: " + info.error;
    window.viewer.error = info.error;
    window.viewer.ready = true;
    return;
  }
  meta.push(info.dimensions[0] + " x " + info.dimensions[1] + " px", info.source);
  if (info.mpp) meta.push(info.mpp.toFixed(3) + " um/px");
  document.getElementById("meta").textContent = meta.join(" | ");
  for (const [kind, why] of Object.entries(info.refused || {})) {  // files the server would not read, and why
    document.getElementById("meta").appendChild(el("p", {class: "error"}, kind + " not shown: " + why));
  }

  const [W, H] = info.dimensions;
  const Z = info.max_zoom;
  const map = L.map("map", {crs: L.CRS.Simple, minZoom: 0, maxZoom: Z + 2, zoomSnap: 1, attributionControl: false, fadeAnimation: false});
  const toLL = (x, y) => map.unproject([x, y], Z);
  const bounds = L.latLngBounds(toLL(0, H), toLL(W, 0));
  const opts = {tileSize: 256, minZoom: 0, maxZoom: Z + 2, maxNativeZoom: Z, bounds: bounds, noWrap: true};
  const layers = {base: L.tileLayer("/tile/" + enc + "/{z}/{x}/{y}.jpg", opts).addTo(map)};
  map.fitBounds(bounds);

  const names = {heatmap: "attention heatmap", tiles: "kept tiles", qc: "QC dropped (red) / flagged (orange)", lesion: "lesion mask"};
  const initial = {heatmap: 0.5, tiles: 1, qc: 1, lesion: 0.4};
  for (const kind of info.overlays) {
    const layer = L.tileLayer("/overlay/" + enc + "/" + kind + "/{z}/{x}/{y}.png", Object.assign({}, opts, {opacity: initial[kind]}));
    layers[kind] = layer;
    layerRow(kind, names[kind], layer, map, initial[kind], (o) => layer.setOpacity(o));
    if (kind === "qc") {
      const reasons = el("div", {class: "layer", id: "qc-reasons"}, "reasons: ");
      for (const reason of info.qc_reasons) {
        const b = el("input", {type: "checkbox", id: "reason-" + reason, checked: ""});
        b.addEventListener("change", () => {
          const on = info.qc_reasons.filter((x) => document.getElementById("reason-" + x).checked);
          layer.setUrl("/overlay/" + enc + "/qc/{z}/{x}/{y}.png?reasons=" + on.join(","));
        });
        reasons.append(b, el("label", {for: "reason-" + reason}, reason + " "));
      }
      document.getElementById("layers").appendChild(reasons);
    }
  }
  const colours = {tissue: "#00a0ff", annotations: "#ffd400"};
  for (const kind of info.geojson) {
    const group = L.layerGroup();
    layers[kind] = group;
    let opacity = 1;
    fetch("/geojson/" + enc + "/" + kind).then((r) => r.json()).then((data) => {
      const g = L.geoJSON(data, {coordsToLatLng: (c) => toLL(c[0], c[1]), style: {color: colours[kind], weight: 2, fill: false, opacity: opacity}});
      group.addLayer(g);
    });
    layerRow(kind, kind === "tissue" ? "tissue contours" : "annotations", group, map, 1, (o) => {
      opacity = o;
      group.eachLayer((g) => g.setStyle({opacity: o}));
    });
  }
  if (info.overlays.includes("heatmap")) {
    const legend = document.getElementById("legend");
    const stops = info.scale.map((c, i) => "rgb(" + c.join(",") + ") " + (100 * i / (info.scale.length - 1)) + "%");
    const grid = info.heatmap_grid;
    legend.append(el("div", {id: "heatmap-grid"}, "attention rank in the slide (" + grid.tiles + " tiles of " + grid.size.join(", ") + " level-0 px)"),
                  Object.assign(el("div", {class: "bar"}), {style: "background: linear-gradient(to right, " + stops.join(", ") + ")"}));
    const ticks = el("div", {class: "ticks"});
    ticks.append(el("span", {}, "0 (lowest)"), el("span", {}, "1 (highest)"));
    legend.appendChild(ticks);
  }
  map.on("click", (e) => {
    const p = map.project(e.latlng, Z);
    fetch("/api/slide/" + enc + "/at?x=" + p.x + "&y=" + p.y).then((r) => r.json()).then((d) => showTile(d.tile));
  });
  Object.assign(window.viewer, {
    map: map, layers: layers, Z: Z, W: W, H: H, toLL: toLL,
    // container px of level-0 point (x, y)
    toScreen: (x, y) => map.latLngToContainerPoint(toLL(x, y)),
    // true when no tile layer on the map is still loading
    idle: () => Object.values(layers).every((l) => !map.hasLayer(l) || !l.isLoading || !l.isLoading()),
    ready: true,
  });
}

fetch("/api/slide/" + enc).then((r) => r.json()).then(init).catch((err) => {
  window.viewer.error = String(err);
  window.viewer.ready = true;
});
