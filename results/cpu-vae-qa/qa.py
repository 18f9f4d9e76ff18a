import json, time, uuid, urllib.request, urllib.error, sys, os
URL = os.environ.get("QA_URL", "http://127.0.0.1:8473")

def get(path, timeout=30):
    with urllib.request.urlopen(URL + path, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")

def post(path, payload):
    req = urllib.request.Request(URL + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            b = r.read(); return r.status, (json.loads(b) if b.strip() else {})
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")

def queue(api):
    s, b = post("/prompt", {"prompt": api, "client_id": uuid.uuid4().hex})
    return s, b

def wait(pid, timeout=900):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        h = get(f"/history/{pid}")
        if pid in h and h[pid].get("status", {}).get("completed") is not None:
            return h[pid], time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(pid)

def run(api, timeout=900):
    s, b = queue(api)
    if s != 200 or b.get("node_errors"):
        return {"refused": (s, b)}
    e, dt = wait(b["prompt_id"], timeout)
    st = e["status"]
    errs = [m[1] for m in st.get("messages", []) if m[0] == "execution_error"]
    return {"ok": st.get("status_str") == "success", "dt": dt, "outputs": e.get("outputs"),
            "errors": [(x.get("node_type"), x.get("exception_type"), x.get("exception_message")) for x in errs],
            "events": [m[0] for m in st.get("messages", [])]}
