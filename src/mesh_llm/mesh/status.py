"""`mesh-llm mesh status`: read ``GET /api/mesh`` from any member and lay it out as rows."""

from __future__ import annotations

import httpx

from mesh_llm.mesh.security import MeshAuth, client_tls

HEADER = ("node", "state", "url", "models", "load (active/waiting/batch)", "streams", "device",
          "last heartbeat")


class StatusError(Exception):
    pass


def fetch(url: str, token: str | None, api_key: str | None = None, tls_ca: str | None = None) -> dict:
    headers = MeshAuth(token).headers("GET", "/api/mesh") if token else {}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    verify = client_tls(tls_ca) if url.startswith("https") or tls_ca else True
    try:
        reply = httpx.get(url.rstrip("/") + "/api/mesh", headers=headers, verify=verify, timeout=10,
                          trust_env=False)
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach {url}: {exc}") from None
    if reply.status_code == 401:
        raise StatusError(f"{url} needs the mesh token: --mesh-token or MESH_LLM_MESH_TOKEN")
    if reply.status_code != 200:
        raise StatusError(f"{url} answered {reply.status_code}: {reply.text[:200]}")
    try:
        return reply.json()
    except ValueError:
        raise StatusError(f"{url} did not answer with JSON: is it a mesh-llm node in a mesh?") from None


def rows(mesh: dict) -> list[tuple[str, ...]]:
    out = []
    for m in mesh.get("members", []):
        models = ", ".join(e["id"] for e in m.get("models", [])) or ("(client)" if m.get("client") else "-")
        load = ", ".join(f"{e['load']['active']}/{e['load']['waiting']}/{e['load']['max_batch']}"
                         for e in m.get("models", [])) or "-"
        device = (m.get("capacity") or {}).get("device") or "-"
        out.append((m["id"], m.get("state", "?"), m["url"], models, load, str(m.get("streams", 0)), device,
                    f"{m.get('last_heartbeat_s', 0):.1f}s ago"))
    return out
