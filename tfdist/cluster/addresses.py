"""The "host:port" grammar of TF_CONFIG addresses, and when two addresses are one.

A task address is a host name, an IPv4 address in dotted decimal, or a
bracketed IPv6 address (optionally with an interface scope, "[fe80::1%eth0]"),
then ":" and a port from 1 to 65535. Anything else is rejected with the form
to write instead: TensorFlow passes the text to gRPC unchecked, and a typo
surfaces minutes later as a hang.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any

from tfdist.cluster.errors import TFConfigError, received

_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?"
)
# Linux interface names (at most 15 characters) or numeric zone indices.
_SCOPE_RE = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_EXAMPLE = "'host:2222' or '10.0.0.1:2222' or '[::1]:2222'"
# Longer than any real address (253-character host name + port): bounds the work
# done on hostile input.
_MAX_ADDRESS = 300


def split_address(address: Any, *, what: str = "address") -> tuple[str, int]:
    """Splits a "host:port" address into (host, port), validating both.

    Accepts host names, IPv4 addresses (dotted decimal) and bracketed IPv6
    addresses ("[::1]:2222", "[fe80::1%eth0]:2222"); the port must be 1..65535.
    The host of an IPv6 address is returned with its brackets.

    Raises:
      TFConfigError: naming the address, what is wrong and the expected form.
    """
    if not isinstance(address, str):
        raise TFConfigError(
            f"{what} must be a string 'host:port'. Received: {what}={received(address)}. "
            f"Write it as {_EXAMPLE}.")
    shown = received(address)
    if len(address) > _MAX_ADDRESS:
        raise TFConfigError(
            f"{what} is {len(address)} characters long; a 'host:port' address has at most "
            f"{_MAX_ADDRESS}. Received: {what}={shown}. Write it as {_EXAMPLE}.")
    if not address.isascii() or not address.isprintable():
        raise TFConfigError(
            f"{what} contains characters that cannot be in a host name or port (non-ASCII, "
            f"control characters or invalid UTF-8). Received: {what}={shown}. Write it as "
            f"{_EXAMPLE}; internationalised host names must be written in their 'xn--' form.")
    if address != address.strip() or any(c.isspace() for c in address):
        raise TFConfigError(
            f"{what} contains whitespace. Received: {what}={shown}. "
            f"Remove the spaces: {received(address.strip().replace(' ', ''))}.")
    if "://" in address:
        scheme, rest = address.split("://", 1)
        raise TFConfigError(
            f"{what} must be a bare 'host:port' without a scheme. Received: "
            f"{what}={shown}. Write {received(rest)} and, if you need a protocol other "
            f"than gRPC, set \"rpc_layer\": {received(scheme)} in TF_CONFIG instead.")
    if address.startswith("["):
        match = re.fullmatch(r"\[([^\[\]]*)\]:([^:\[\]]*)", address)
        if not match:
            raise TFConfigError(
                f"{what} is not '[IPv6]:port'. Received: {what}={shown}. Bracketed IPv6 "
                f"addresses hold one address and take the port after the bracket: "
                f"'[::1]:2222' or '[fe80::1%eth0]:2222'.")
        host, port_text = match.groups()
        _check_ipv6(host, what, shown)
        host = f"[{host}]"
    else:
        if address.count(":") > 1:
            raise TFConfigError(
                f"{what} looks like an IPv6 address without brackets. Received: "
                f"{what}={shown}. Put the IPv6 address in brackets: '[::1]:2222'.")
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise TFConfigError(
                f"{what} has no port. Received: {what}={shown}. "
                f"Add the port the task listens on, e.g. '{address}:2222'.")
        if not host:
            raise TFConfigError(
                f"{what} has no host. Received: {what}={shown}. "
                f"Write the host before the port, e.g. 'localhost{address}'.")
        if "[" in host or "]" in host:
            raise TFConfigError(
                f"{what} has brackets in the wrong place. Received: {what}={shown}. Only an "
                f"IPv6 address is bracketed, and the whole address: '[::1]:2222'.")
        _check_host(host, what, shown)
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 1 <= int(port_text) <= 65535:
        raise TFConfigError(
            f"{what} has an invalid port {received(port_text)}. Received: {what}={shown}. "
            f"The port must be an integer from 1 to 65535, e.g. '{host}:2222'.")
    return host, int(port_text)


def _check_ipv6(host: str, what: str, shown: str) -> None:
    plain, _, scope = host.partition("%")
    if "%" in host and not _SCOPE_RE.fullmatch(scope):
        raise TFConfigError(
            f"{what} has an invalid IPv6 scope {received(scope)} (the part after '%'). "
            f"Received: {what}={shown}. A scope is an interface name or number, e.g. "
            f"'[fe80::1%eth0]:2222'.")
    try:
        ip = ipaddress.IPv6Address(plain)
    except ValueError:
        raise TFConfigError(
            f"{what} has an invalid IPv6 address {received(plain)}. Received: {what}={shown}."
        ) from None
    _check_usable(ip, what, shown)


def _check_host(host: str, what: str, shown: str) -> None:
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ip = ipaddress.IPv4Address(host)
        except ValueError:
            raise TFConfigError(
                f"{what} has an invalid IPv4 address {received(host)}. Received: "
                f"{what}={shown}. Write four numbers from 0 to 255: 'a.b.c.d:port'."
            ) from None
        _check_usable(ip, what, shown)
        return
    if not _HOSTNAME_RE.fullmatch(host):
        raise TFConfigError(
            f"{what} has an invalid host name {received(host)}. Received: {what}={shown}. "
            f"Use a host name, an IPv4 address or a bracketed IPv6 address: {_EXAMPLE}.")
    try:
        # The C resolver reads '0x7f.1' or '127.1' as an IPv4 address: another
        # spelling of an address would hide a duplicate, so ask for the usual one.
        packed = socket.inet_aton(host.rstrip("."))
    except OSError:
        return
    raise TFConfigError(
        f"{what} writes an IPv4 address in an unusual form {received(host)}. Received: "
        f"{what}={shown}. Write it in dotted decimal: "
        f"'{socket.inet_ntoa(packed)}:PORT'.")


def _check_usable(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, what: str,
                  shown: str) -> None:
    if ip.is_unspecified or ip.is_multicast or (
            isinstance(ip, ipaddress.IPv4Address) and ip == ipaddress.IPv4Address(
                "255.255.255.255")):
        kind = ("an unspecified (bind-all) address" if ip.is_unspecified
                else "a multicast or broadcast address")
        raise TFConfigError(
            f"{what} is {kind}, which other tasks cannot connect to. Received: "
            f"{what}={shown}. Write the address of the machine the task runs on "
            f"(127.0.0.1 for a task on this machine).")


def is_loopback(host: str) -> bool:
    """True for 'localhost', 127.0.0.0/8, ::1 and ::ffff:127.x (brackets allowed)."""
    host = host.lower().rstrip(".").strip("[]").partition("%")[0]
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def address_key(address: str) -> tuple[str, int]:
    """What identifies an address for duplicate detection.

    Two addresses with the same key cannot both be served. IP addresses are
    compared as numbers ('[::1]' is '[0:0:0:0:0:0:0:1]', '[::ffff:10.0.0.1]' is
    '10.0.0.1'), host names without letter case or the final dot, and every
    loopback spelling (localhost, 127.0.0.0/8, ::1) is one machine: a
    TensorFlow server binds its port on every interface, so two local tasks
    on one port collide whatever loopback address they name.
    """
    host, port = split_address(address)
    if is_loopback(host):
        return "loopback", port
    bare = host.lower().rstrip(".").strip("[]")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return bare, port
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), port
