// The slide list: one page of /api/slides at a time, sorted by a clicked column (again: the other order).
"use strict";
const state = {sort: "name", order: "asc", offset: 0, limit: 50, q: "", total: 0};
const fmt = (v) => (v === null || v === undefined) ? "" : (typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : String(v));

function load() {
  const p = new URLSearchParams({sort: state.sort, order: state.order, offset: state.offset, limit: state.limit, q: state.q});
  return fetch("/api/slides?" + p).then((r) => r.json()).then((data) => {
    state.total = data.total;
    document.getElementById("sources").textContent = data.total + " slides from " + data.sources.join("; ");
    const body = document.querySelector("#slides tbody");
    body.replaceChildren();
    for (const r of data.rows) {
      const tr = document.createElement("tr");
      tr.dataset.slide = r.slide_id;
      if (r.status !== "ok") tr.classList.add("failed");
      const a = document.createElement("a");
      a.href = "/slide/" + encodeURIComponent(r.slide_id);
      a.textContent = r.slide_id;
      const cells = [a, fmt(r.file) + (r.file ? "" : (r.store ? "(tile store)" : "")), fmt(r.label), fmt(r.split),
                     fmt(r.pred), fmt(r.prob), fmt(r.risk), r.heatmap ? "yes" : "",
                     r.status === "ok" ? "ok" : "cannot open: " + r.status];
      for (const c of cells) {
        const td = document.createElement("td");
        if (c instanceof Node) td.appendChild(c); else td.textContent = c;
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
    const pages = Math.max(1, Math.ceil(state.total / state.limit));
    document.getElementById("pageinfo").textContent = "page " + (Math.floor(state.offset / state.limit) + 1) + " of " + pages;
    document.getElementById("prev").disabled = state.offset === 0;
    document.getElementById("next").disabled = state.offset + state.limit >= state.total;
    for (const th of document.querySelectorAll("th[data-sort]")) {
      th.classList.toggle("sorted", th.dataset.sort === state.sort);
      th.dataset.order = th.dataset.sort === state.sort ? state.order : "";
    }
    document.body.dataset.loaded = String(Date.now());
  });
}

for (const th of document.querySelectorAll("th[data-sort]")) {
  th.addEventListener("click", () => {
    state.order = (state.sort === th.dataset.sort && state.order === "asc") ? "desc" : "asc";
    state.sort = th.dataset.sort;
    state.offset = 0;
    load();
  });
}
document.getElementById("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - state.limit); load(); });
document.getElementById("next").addEventListener("click", () => { state.offset += state.limit; load(); });
document.getElementById("filter").addEventListener("input", (e) => { state.q = e.target.value; state.offset = 0; load(); });
load();
