"""Queue shipped workflows (workflows/<name>.api.json) as they are, on the server start.sh started; one JSON line each.

A first-hour user on a machine without GPUs: device auto gives CPU ranks. Nothing is resized. Per workflow: success
or the error (node type, exception, message), the seconds, and the text each PatchRay node showed.

    python run_shipped.py [name ...]  (QA_URL, default http://127.0.0.1:8493; QA_TIMEOUT seconds per workflow, 1500)
"""
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

URL = os.environ.get("QA_URL", "http://127.0.0.1:8493")
ROOT = Path(__file__).resolve().parents[2]


def _get(path):
    with urllib.request.urlopen(URL + path, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def _post(path, payload):
    req = urllib.request.Request(URL + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            b = r.read()
            return r.status, (json.loads(b) if b.strip() else {})
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def run(name, timeout):
    api = json.loads((ROOT / "workflows" / f"{name}.api.json").read_text())
    t0 = time.monotonic()
    status, body = _post("/prompt", {"prompt": api, "client_id": uuid.uuid4().hex})
    if status != 200 or body.get("node_errors"):
        return {"workflow": name, "queued": False, "status": status, "error": body.get("error"),
                "node_errors": body.get("node_errors")}
    pid = body["prompt_id"]
    while time.monotonic() - t0 < timeout:
        hist = _get(f"/history/{pid}")
        if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
            entry = hist[pid]
            msgs = entry["status"].get("messages", [])
            errs = [m[1] for m in msgs if m[0] == "execution_error"]
            texts = {nid: out.get("text") for nid, out in entry.get("outputs", {}).items() if out.get("text")}
            return {"workflow": name, "queued": True, "ok": entry["status"].get("status_str") == "success",
                    "seconds": round(time.monotonic() - t0, 1),
                    "errors": [(e.get("node_type"), e.get("exception_type"), e.get("exception_message")) for e in errs],
                    "node_text": texts}
        time.sleep(1)
    _post("/interrupt", {})
    return {"workflow": name, "queued": True, "ok": False, "timed_out_s": timeout}


def main(names):
    timeout = float(os.environ.get("QA_TIMEOUT", "1500"))
    for name in names:
        print(json.dumps(run(name, timeout)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
