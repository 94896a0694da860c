"""A recording test double of huggingface_hub's `HfApi` for `--push-to-hub`: it records what the command asks of the Hub
and answers without a network. Tests put it in place of `moe_rewrite.publish.HfApi` (in-process with monkeypatch, or in
test_publish's worker process). Not a test module: it imports neither pytest nor conftest."""

from __future__ import annotations

from types import SimpleNamespace

TOKEN = "hf_moeRewriteTestToken0123456789abcdefXYZ"


def _response(status: int) -> SimpleNamespace:
    """What HfHubHTTPError (requests- or httpx-based, huggingface_hub 0.x and 1.x) reads from a response."""
    return SimpleNamespace(status_code=status, headers={"x-request-id": "Root=1-test"}, request=None)


def make_error(kind: str) -> Exception:
    """The errors huggingface_hub raises for the failures a push meets, as its own exception types."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    url = "https://huggingface.co/api/models/someone/repo/commit/main"
    if kind == "unauthorized":
        message = f"401 Client Error: Unauthorized for url: {url}\n\nInvalid credentials"
        return HfHubHTTPError(message, response=_response(401))
    if kind == "forbidden":
        message = f"403 Forbidden: you don't have the rights to create a commit.\nCannot access content at: {url}."
        return HfHubHTTPError(message, response=_response(403))
    if kind == "not_found":
        message = f"404 Client Error. Repository Not Found for url: {url}."
        return RepositoryNotFoundError(message, response=_response(404))
    if kind == "gated":
        return GatedRepoError(f"403 Client Error. Cannot access gated repo for url {url}.", response=_response(403))
    if kind == "revision_not_found":
        return RevisionNotFoundError(f"404 Client Error. Revision Not Found for url: {url}.", response=_response(404))
    if kind == "server_echoes_token":
        return HfHubHTTPError(f"500 Server Error: bad header 'Bearer {TOKEN}'\nmore", response=_response(500))
    if kind == "refused":  # what requests (huggingface_hub 0.x) raises, urllib3's text inside
        message = (
            "HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded with url: /api/repos/create "
            "(Caused by NewConnectionError('<urllib3.connection.HTTPSConnection object at 0x7f3a2c1d0e50>: Failed "
            "to establish a new connection: [Errno 111] Connection refused'))"
        )
        return _network_error("ConnectionError", message)
    if kind == "timeout":
        return _network_error("ReadTimeout", "The read operation timed out")
    raise ValueError(kind)


def _network_error(name: str, message: str) -> Exception:
    """requests' exception of that name (huggingface_hub 0.x), else httpx's closest one (1.x)."""
    try:
        import requests.exceptions as module
    except ImportError:
        import httpx as module

        name = {"ConnectionError": "ConnectError"}.get(name, name)
    return getattr(module, name)(message)


class RecordingHfApi:
    """Records every call as (name, arguments) in the class-level `calls`; `fail` maps a method name to the error
    it raises. Methods the command should not use do not exist here, so calling one fails the test."""

    calls: list = []
    fail: dict = {}

    def __init__(self, token=None, **kwargs):
        self.calls.append(("HfApi", {"token": token, **kwargs}))

    def _call(self, name: str, arguments: dict) -> None:
        self.calls.append((name, arguments))
        if name in self.fail:
            raise make_error(self.fail[name])

    def create_repo(self, repo_id, **kwargs):
        self._call("create_repo", {"repo_id": repo_id, **kwargs})
        return f"https://huggingface.co/{repo_id}"

    def create_commit(self, repo_id, operations, **kwargs):
        ops = [(op.path_in_repo, _content(op.path_or_fileobj)) for op in operations]
        self._call("create_commit", {"repo_id": repo_id, "operations": ops, **kwargs})
        commit_url = f"https://huggingface.co/{repo_id}/commit/{'0' * 40}"
        pr_url = f"https://huggingface.co/{repo_id}/discussions/7" if kwargs.get("create_pr") else None
        return SimpleNamespace(commit_url=commit_url, pr_url=pr_url, oid="0" * 40)


def _content(data) -> str:
    """An operation's content as text (every file a push may upload is UTF-8); a path or file object as itself."""
    if isinstance(data, bytes):
        return data.decode("utf-8")
    if hasattr(data, "read"):
        return data.read().decode("utf-8")
    with open(data, "rb") as f:
        return f.read().decode("utf-8")


def reset(fail: dict | None = None) -> None:
    RecordingHfApi.calls = []
    RecordingHfApi.fail = dict(fail or {})
