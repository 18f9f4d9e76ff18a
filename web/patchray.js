// PatchRay's frontend extension: renders the topology matrix and the benchmark table inside their nodes,
// and shows the text the other PatchRay nodes report (cluster info, tile plans, fallback warnings).
// This file is served as /extensions/PatchRay/patchray.js, so ComfyUI's app module is two levels up.
import { app } from "../../scripts/app.js";

const VIEW = "patchray_view";
const TEXT_NODES = new Set(["PatchRayCluster", "PatchRayTilePlanner", "PatchRayVAEDecode", "PatchRayVAEEncode"]);

function el(tag, style, text) {
  const e = document.createElement(tag);
  if (style) e.style.cssText = style;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

// One DOM widget per node, created on first use; never serialized into the workflow or the prompt.
function view(node) {
  let w = node.widgets?.find((x) => x.name === VIEW);
  if (!w) {
    const box = el("div", "overflow:auto;max-height:420px;font:11px monospace;color:var(--input-text,#ddd);" +
      "background:var(--comfy-input-bg,#222);padding:4px;border-radius:4px;white-space:pre");
    w = node.addDOMWidget(VIEW, "patchray", box, { serialize: false, hideOnZoom: false });
    w.serialize = false;
  }
  w.element.replaceChildren();
  return w.element;
}

function fmt(x, digits = 1) {
  return x === null || x === undefined || Number.isNaN(x) ? "-" : Number(x).toFixed(digits);
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
    box.appendChild(table);
  }
  if (report.cluster) {
    const c = report.cluster;
    box.appendChild(el("div", "", c.error ? `cluster: ${c.error}` :
      `cluster: ${c.ranks} rank(s) ${c.backend}, all_reduce ${c.all_reduce_ok ? "ok" : "FAILED"}, exchange ${c.p2p_ok ? "ok" : "FAILED"}`));
  }
  for (const a of report.advice || []) {
    box.appendChild(el("div", "margin-top:2px;white-space:normal", `• ${a.message || a.title || JSON.stringify(a)}`));
  }
}

// Benchmark table: one row per record (mode/plan), with status, latency, memory, traffic and error vs. reference.
export function renderBench(box, payload) {
  const records = payload.records || [];
  if (payload.file) box.appendChild(el("div", "opacity:.7", `output/patchray/${payload.file}`));
  const cols = [
    ["shape", (r) => (r.shape || {}).label || ""],
    ["case", (r) => r.name],
    ["status", (r) => r.status || (r.error ? "error" : "ok")],
    ["ms", (r) => fmt(r.latency_ms)],
    ["peak GiB", (r) => ((r.peak_memory || {}).bytes == null ? "-" : fmt(r.peak_memory.bytes / 2 ** 30, 3))],
    ["MiB sent", (r) => (r.wire_bytes_by_rank ? fmt(Math.max(...r.wire_bytes_by_rank) / 2 ** 20, 2) : "-")],
  ];
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
  box.appendChild(table);
}

app.registerExtension({
  name: "PatchRay.views",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const name = nodeData?.name;
    if (name !== "PatchRayTopologyProbe" && name !== "PatchRayBenchmark" && !TEXT_NODES.has(name)) return;
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
        this.setDirtyCanvas?.(true, true);
      } catch (err) {
        console.error("PatchRay: could not render the node's result", err);
      }
    };
  },
});
