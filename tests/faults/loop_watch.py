"""Watching a real service's event loop while one hostile request runs: the request goes from a process of
its own, so this one only measures, and ``/health`` is timed meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx


def post_in_another_process(url: str, body_file: str, headers: dict[str, str]) -> subprocess.Popen:
    """POST a body from a process of its own; it prints ``{status, text (the first 2000 characters),
    events (the server-sent events it read)}`` as JSON when the answer has all come."""
    code = (
        "import httpx, json, sys; body = open(sys.argv[2], 'rb').read(); "
        "answer = httpx.post(sys.argv[1], content=body, headers=json.loads(sys.argv[3]), timeout=600); "
        "print(json.dumps({'status': answer.status_code, 'text': answer.text[:2000], "
        "'events': answer.text.count('data: {')}))"
    )
    command = [sys.executable, "-c", code, url, body_file, json.dumps(headers)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def health_latencies_during(process: subprocess.Popen, base_url: str) -> list[float]:
    """How long each ``/health`` took, called back to back until ``process`` ends."""
    latencies = []
    with httpx.Client(timeout=600) as http:
        while process.poll() is None:
            started = time.perf_counter()
            assert http.get(f"{base_url}/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)
    return latencies
