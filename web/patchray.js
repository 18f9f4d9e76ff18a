// PatchRay's frontend extension: a readable panel inside each PatchRay node that reports something (the topology
// matrix, the benchmark table, the cluster's ranks, the tile plans, decode notes).
// This file is served as /extensions/PatchRay/patchray.js, so ComfyUI's app module is two levels up.
import { app } from "../../scripts/app.js";

const VIEW = "patchray_view";
// The panel's minimum height per node (px). The shipped workflows size nodes to hold it
// (tests/comfyui/workflow_tools.py EXTRA_HEIGHT is at least this plus the widget margin; a test compares them).
export const PANEL = {
  PatchRayCluster: 100,
  PatchRayParallelModel: 80,
  PatchRayTilePlanner: 220,
  PatchRayTopologyProbe: 210,
  PatchRayBenchmark: 230,
  PatchRaySamplerBenchmark: 160,
  PatchRayVAEDecode: 60,
  PatchRayVAEEncode: 60,
  PatchRayParallelVAE: 60,
  PatchRayKSampler: 60,
  PatchRayKSamplerAdvanced: 60,
};
// The width a node opens with when added from the menu, so its panel's lines are readable (the shipped workflows
// use tests/comfyui/workflow_tools.py MIN_WIDTH, at least these; a test compares them).
export const WIDTH = {
  PatchRayCluster: 400,
  PatchRayTilePlanner: 520,
  PatchRayTopologyProbe: 520,
  PatchRayBenchmark: 560,
};
const HINT = "Runs when the prompt is queued; the result shows here.";

function el(tag, style, text) {
  const e = document.createElement(tag);
  if (style) e.style.cssText = style;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

// One DOM widget per node, created with the node; never serialized into the workflow or the prompt.
// It fills the node's free height (at least PANEL[type]); long text wraps, wide tables scroll sideways.
function view(node, clear = true) {
  let w = node.widgets?.find((x) => x.name === VIEW);
  if (!w) {
    const min = PANEL[node.comfyClass || node.type] ?? 60;
    const box = el("div", "box-sizing:border-box;height:100%;overflow:auto;font:12px/1.35 monospace;" +
      "color:var(--input-text,#ddd);background:var(--comfy-input-bg,#222);padding:4px 6px;border-radius:4px;" +
      "white-space:pre-wrap;overflow-wrap:anywhere");
    w = node.addDOMWidget(VIEW, "patchray", box, { serialize: false, hideOnZoom: false, getMinHeight: () => min });
    w.serialize = false;
    box.appendChild(el("div", "opacity:.6", HINT));
  }
  if (clear) w.element.replaceChildren();
  return w.element;
}

// Grow the node when its content needs more than it has (never shrink what the user sized).
function fit(node) {
  const need = node.computeSize?.();
  if (!need) return;
  const w = Math.max(node.size[0], need[0]);
  const h = Math.max(node.size[1], need[1]);
  if (w !== node.size[0] || h !== node.size[1]) node.setSize([w, h]);
}

function fmt(x, digits = 1) {
  return x === null || x === undefined || Number.isNaN(x) ? "-" : Number(x).toFixed(digits);
}

// width x height (x frames), ComfyUI's widget order
export function sizeLabel(shape) {
  if (!shape) return "";
  const { height, width, frames } = shape;
  if (height === undefined || width === undefined) return shape.label || "";
  return `${width}x${height}` + (frames && frames > 1 ? `x${frames}` : "");
}

// peak memory of a record in GiB: the measured peak of whichever kind the device has (GPU allocator or the CPU
// process's resident peak); the same figure the chart draws
export function peakGiB(r) {
  const p = r.peak_memory || {};
  if (p.max_gib != null) return fmt(p.max_gib, 3); // the figure the chart draws (max over ranks)
  let bytes = p.bytes;
  if (bytes == null && Array.isArray(p.bytes_by_rank)) bytes = Math.max(...p.bytes_by_rank.filter((b) => b != null));
  if (bytes == null && Array.isArray(r.peak_memory_by_rank)) {
    bytes = Math.max(...r.peak_memory_by_rank.map((m) => (m && m.bytes) ?? -Infinity));
    if (!Number.isFinite(bytes)) bytes = null;
  }
  return bytes == null ? "-" : fmt(bytes / 2 ** 30, 3);
}

// P2P matrix: one cell per GPU pair with the link kind, P2P status and measured copy bandwidth (GB/s).
export function renderTopology(box, report) {
  for (const node of report.nodes || []) {
    box.appendChild(el("div", "font-weight:bold;margin:2px 0", `${node.host || "node"}: ${(node.gpus || []).length} GPU(s)`));
    const gpus = node.gpus || [];
    if (gpus.length === 0) {
      box.appendChild(el("div", "", (node.notes || report.notes || []).join("\n") || "no GPU found"));
      continue;
    }
    const pair = {};
    for (const p of node.pairs || []) {
      pair[`${p.a},${p.b}`] = p;
      pair[`${p.b},${p.a}`] = { ...p, copy_gbps: p.copy_gbps_reverse ?? p.copy_gbps };
    }
    const wrap = el("div", "overflow-x:auto;white-space:nowrap");
    const table = el("table", "border-collapse:collapse;margin:4px 0");
    const head = el("tr");
    head.appendChild(el("th", "padding:2px 4px", ""));
    for (const g of gpus) head.appendChild(el("th", "padding:2px 4px", `GPU${g.index}`));
    table.appendChild(head);
    for (const a of gpus) {
      const row = el("tr");
      row.appendChild(el("th", "padding:2px 4px;text-align:left", `GPU${a.index} ${a.name || ""}`));
      for (const b of gpus) {
        if (a.index === b.index) {
          row.appendChild(el("td", "padding:2px 4px;text-align:center;opacity:.5", "X"));
          continue;
        }
        const p = pair[`${a.index},${b.index}`] || {};
        const ok = p.p2p_ok;
        const bg = ok === true ? "#1d5e2a" : ok === false ? "#6b1f1f" : "#444";
        const cell = el("td", `padding:2px 6px;text-align:center;border:1px solid #555;background:${bg}`,
          `${p.link || "?"}${p.copy_gbps ? " " + fmt(p.copy_gbps) : ""}`);
        cell.title = `${p.link_class || ""} P2P ${ok === true ? "ok" : ok === false ? "not available" : "unknown"}` +
          (p.copy_gbps ? `, ${fmt(p.copy_gbps)} GB/s measured` : "");
        row.appendChild(cell);
      }
      table.appendChild(row);
    }
    wrap.appendChild(table);
    box.appendChild(wrap);
    box.appendChild(el("div", "opacity:.7", "cell: link kind and measured GB/s; green: P2P works, red: no P2P"));
  }
  if (report.cluster) {
    const c = report.cluster;
    box.appendChild(el("div", "", c.error ? `cluster: ${c.error}` :
      `cluster: ${c.ranks} rank(s) ${c.backend}, all_reduce ${c.all_reduce_ok ? "ok" : "FAILED"}, exchange ${c.p2p_ok ? "ok" : "FAILED"}`));
  }
  for (const a of report.advice || []) {
    box.appendChild(el("div", "margin-top:2px", `• ${a.message || a.title || JSON.stringify(a)}`));
  }
}

// Benchmark table: one row per record (mode/plan), with status, latency, memory, traffic and error vs. reference.
export function renderBench(box, payload) {
  const records = payload.records || [];
  if (payload.file) box.appendChild(el("div", "opacity:.7", `output/patchray/${payload.file}`));
  const cols = [
    ["size", (r) => sizeLabel(r.shape)],
    ["case", (r) => r.name],
    ["status", (r) => r.status || (r.error ? "error" : "ok")],
    ["ms", (r) => fmt(r.latency_ms)],
    ["peak GiB", peakGiB],
    ["MiB sent", (r) => (r.wire_bytes_by_rank ? fmt(Math.max(...r.wire_bytes_by_rank) / 2 ** 20, 2) : "-")],
  ];
  const wrap = el("div", "overflow-x:auto;white-space:nowrap");
  const table = el("table", "border-collapse:collapse;margin:4px 0");
  const head = el("tr");
  for (const [name] of cols) head.appendChild(el("th", "padding:2px 6px;border-bottom:1px solid #777", name));
  table.appendChild(head);
  for (const r of records) {
    const row = el("tr");
    for (const [, get] of cols) row.appendChild(el("td", "padding:2px 6px;text-align:right", get(r)));
    if (r.error && r.error.message) row.title = r.error.message;
    table.appendChild(row);
  }
  if (records.length === 0) box.appendChild(el("div", "", "no records: see the report file"));
  wrap.appendChild(table);
  box.appendChild(wrap);
}

// Nodes whose panel shows a note only when a run differs from what was asked (a fallback to ComfyUI's own VAE, a
// row-tiled retry, an unused plan): a run without a note sends the panel nothing, so each new prompt clears the
// last run's note (a cached node's note is sent again), and a note never outlives the run it was about.
export const NOTE_ONLY = ["PatchRayVAEDecode", "PatchRayVAEEncode", "PatchRayParallelVAE"];

export function clearNotes(nodes) {
  let cleared = 0;
  for (const node of nodes || []) {
    if (!NOTE_ONLY.includes(node.comfyClass || node.type)) continue;
    const w = node.widgets?.find((x) => x.name === VIEW);
    if (!w?.element) continue;
    w.element.replaceChildren(el("div", "opacity:.6", HINT));
    cleared++;
  }
  return cleared;
}

// A PatchRay node whose run failed or was cancelled: its panel no longer shows an earlier run's result (which the
// widgets as they are now did not produce). Returns whether a panel was reset.
export function endedWithout(nodes, nodeId, outcome) {
  const node = (nodes || []).find((n) => String(n.id) === String(nodeId));
  if (!node || !((node.comfyClass || node.type) in PANEL)) return false;
  const w = node.widgets?.find((x) => x.name === VIEW);
  if (!w?.element) return false;
  const why = outcome === "execution_interrupted" ? "This node's last run was cancelled." :
    "This node's last run failed (the error message says why).";
  w.element.replaceChildren(el("div", "opacity:.6", `${why} ${HINT}`));
  return true;
}

app.registerExtension({
  name: "PatchRay.views",
  async setup() {
    app.api?.addEventListener?.("execution_start", () => {
      try {
        if (clearNotes(app.graph?._nodes)) app.graph?.setDirtyCanvas?.(true, true);
      } catch (err) {
        console.error("PatchRay: could not clear the last run's notes", err);
      }
    });
    // what ran on the ranks, for a node whose effect comes after its own run (PatchRay Parallel Model: the sampler
    // node that samples its MODEL sends the lines)
    app.api?.addEventListener?.("patchray.report", (event) => {
      try {
        const node = app.graph?.getNodeById?.(Number(event?.detail?.node)) ??
          app.graph?._nodes?.find((n) => String(n.id) === String(event?.detail?.node));
        if (!node || !((node.comfyClass || node.type) in PANEL) || !event?.detail?.text) return;
        view(node, false).appendChild(el("div", "", event.detail.text));
        fit(node);
        node.setDirtyCanvas?.(true, true);
      } catch (err) {
        console.error("PatchRay: could not show a report on its node", err);
      }
    });
    for (const outcome of ["execution_error", "execution_interrupted"]) {
      app.api?.addEventListener?.(outcome, (event) => {
        try {
          if (endedWithout(app.graph?._nodes, event?.detail?.node_id, outcome)) app.graph?.setDirtyCanvas?.(true, true);
        } catch (err) {
          console.error("PatchRay: could not reset the panel of a node whose run ended early", err);
        }
      });
    }
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const name = nodeData?.name;
    if (!(name in PANEL)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      try {
        view(this, false); // the panel exists from the start, so the node opens at the size that shows it
        const width = WIDTH[name];
        if (width && this.size[0] < width) this.setSize([width, this.size[1]]);
      } catch (err) {
        console.error("PatchRay: could not add the node's panel", err);
      }
      return r;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      try {
        if (name === "PatchRayTopologyProbe" && message?.patchray_topology?.[0]) {
          renderTopology(view(this), message.patchray_topology[0]);
        } else if (name === "PatchRayBenchmark" && message?.patchray_bench?.[0]) {
          renderBench(view(this), message.patchray_bench[0]);
        } else if (message?.text?.length) {
          view(this).appendChild(el("div", "", message.text.join("\n")));
        }
        fit(this);
        this.setDirtyCanvas?.(true, true);
      } catch (err) {
        console.error("PatchRay: could not render the node's result", err);
      }
    };
  },
});
