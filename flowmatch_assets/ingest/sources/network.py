"""The network side of a remote source location: every connection a source makes (http(s),
s3 endpoints) goes through one address guard, the downloads' policy
(:func:`~flowmatch_assets.ingest.fetch.address_refusal`), checked on the address each socket
is for. Other schemes never get here: ``config.check_location`` refuses them."""

from __future__ import annotations

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError


def guarded_socket(what: str, allow_networks=()):
    """A socket factory (aiohttp's ``TCPConnector(socket_factory=...)``) that refuses, before
    connecting, every address the downloads' policy refuses
    (:func:`~flowmatch_assets.ingest.fetch.address_refusal`; ``allow_networks`` allowed too):
    the check is on the very address the socket is for, so a DNS answer that changes between
    a check and the connect cannot slip by. ``what`` names the host in the refusal."""
    import ipaddress
    import socket

    from flowmatch_assets.ingest.fetch import address_refusal

    allowed = tuple(ipaddress.ip_network(n, strict=False) for n in allow_networks)

    def socket_factory(addr_info) -> socket.socket:
        family, type_, proto, _name, sockaddr = addr_info
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        why = address_refusal(ip, allowed)
        if why is not None:
            raise IngestError(
                "private_address",
                f"{what} reaches {ip} ({why}): not read; "
                "ingest.allow_networks (FLOWMATCH_ALLOW_NETWORKS) allows chosen networks",
            )
        return socket.socket(family, type_, proto)

    return socket_factory


def guarded_http(cfg: SourceConfig):
    """fsspec's HTTP filesystem for ``cfg.location`` behind the downloads' address policy
    (ingest/fetch.py): every connection, redirects included, goes through
    :func:`guarded_socket` (else ``private_address``); a redirect off the location's host (or
    to another scheme) is ``redirect_refused``; no proxy from the environment."""
    import aiohttp
    from fsspec.implementations.http import HTTPFileSystem
    from yarl import URL

    home = URL(cfg.location)
    socket_factory = guarded_socket(f"the source's host {home.host}", cfg._allow_networks)

    async def on_redirect(_session, _ctx, params) -> None:
        target = params.url.join(URL(params.response.headers.get("Location", "")))
        if target.scheme not in ("http", "https") or (target.host, target.port) != (
            home.host,
            home.port,
        ):
            raise IngestError(
                "redirect_refused",
                f"{params.url.path} redirects off the source's host ({target.scheme}://"
                f"{target.host}:{target.port})",
            )

    async def get_client(**kwargs):
        trace = aiohttp.TraceConfig()
        trace.on_request_redirect.append(on_redirect)
        connector = aiohttp.TCPConnector(socket_factory=socket_factory)
        kwargs.setdefault("timeout", aiohttp.ClientTimeout(total=cfg.deadline_s))
        return aiohttp.ClientSession(
            connector=connector, trace_configs=[trace], trust_env=False, **kwargs
        )

    return HTTPFileSystem(get_client=get_client, skip_instance_cache=True)


def guarded_s3(cfg: SourceConfig):
    """s3fs for an ``s3://`` location, every connection it makes (to the endpoint of
    ``AWS_ENDPOINT_URL`` or the AWS config, and any proxy) through :func:`guarded_socket`:
    an endpoint on an internal address is refused before connecting, as an http source
    would be. Credentials come from the standard AWS variables and files, never from us."""
    try:
        import s3fs
    except ImportError:  # pragma: no cover - a dependency; named if an install lacks it
        raise SourceError("an s3:// location needs the s3fs package (pip install s3fs)") from None
    bucket = cfg.location.split("://", 1)[1].split("/", 1)[0]
    factory = guarded_socket(f"the s3 endpoint of bucket {bucket}", cfg._allow_networks)
    return s3fs.S3FileSystem(
        skip_instance_cache=True, config_kwargs={"connector_args": {"socket_factory": factory}}
    )
