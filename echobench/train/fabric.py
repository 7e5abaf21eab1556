"""Fabric profiles: named sets of NCCL / libfabric settings for a cluster's interconnect, and how to
read back which network NCCL really chose (preflight holds it against the profile).

None is applied unless a matrix chooses one (`slurm.fabric`; a matrix with multi-node GPU runs must
name one, `none` included), because a wrong one fails at NCCL's start (an interface that does not
exist) or runs slowly over sockets; the matrix's own `slurm.env` overrides any variable of a
profile. Every job sets NCCL_DEBUG=VERSION (unless the matrix sets NCCL_DEBUG), so its log names
the NCCL that ran.

This module imports nothing outside the standard library: the preflight's node check
(echobench.train.nodecheck) reads it on nodes where echobench's dependencies may be missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fabric:
    what: str
    source: str
    env: dict[str, str] = field(default_factory=dict)
    # NCCL networks (as NCCL names them: "IB", "Socket", "AWS Libfabric") that count as this fabric
    # across nodes; () takes any. Anything else is a failed preflight, with `missing` as its fix.
    networks: tuple[str, ...] = ()
    missing: str = ""
    clues: tuple[str, ...] = ()  # NCCL's lines about this fabric's network that say why it was not taken
    # Variables the Container Engine's aws-ofi-nccl hook sets inside the container: under
    # `container.runtime: ce` the job leaves them to it (the matrix's env still wins).
    hook_sets: frozenset[str] = frozenset()


# CSCS's recommended Slingshot settings for NCCL through aws-ofi-nccl (Alps); the Container
# Engine's hook sets these for a container that enables it.
SLINGSHOT_OFI = {"NCCL_NET": "AWS Libfabric", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_CROSS_NIC": "1",
                 "FI_CXI_DEFAULT_CQ_SIZE": "131072", "FI_CXI_DEFAULT_TX_SIZE": "32768",
                 "FI_CXI_DISABLE_HOST_REGISTER": "1", "FI_CXI_RX_MATCH_MODE": "software",
                 "FI_MR_CACHE_MONITOR": "userfaultfd"}

FABRICS: dict[str, Fabric] = {
    "none": Fabric("nothing set: NCCL's own choices (right on a single node, and where the cluster's "
                   "modules set the variables)", "-"),
    "slingshot": Fabric(
        "HPE Slingshot 11 (quad-GH200 systems such as Alps, Isambard-AI, Olivia): NCCL through the "
        "aws-ofi-nccl plugin and libfabric's cxi provider; the plugin must be on the nodes (a module or "
        "uenv loaded in slurm.setup, or the Container Engine's aws_ofi_nccl hook); NCCL_PROTO=^LL128 is "
        "added at launch where torch's NCCL is 2.27 or newer",
        "CSCS's NCCL guide for Alps (docs.cscs.ch, communication libraries: NCCL), Isambard-AI's "
        "(docs.isambard.ac.uk/user-documentation/guides/nccl) and HPE's shs-ccl-docs ccl_env.sh",
        {**SLINGSHOT_OFI, "NCCL_SOCKET_IFNAME": "hsn", "GLOO_SOCKET_IFNAME": "hsn0"},
        networks=("AWS Libfabric", "Libfabric", "OFI"),
        missing="the aws-ofi-nccl plugin did not load (libnccl-net.so not found, or no cxi device): load its "
                "module or uenv in slurm.setup, or with the Container Engine enable the hook in the EDF "
                '(com.hooks.aws_ofi_nccl.enabled = "true")',
        clues=("NET/Plugin", "NET/OFI", "WARN"), hook_sets=frozenset(SLINGSHOT_OFI)),
    "infiniband": Fabric(
        "InfiniBand (x86 H100 / H200 HGX clusters, JUPITER-class GH200 boosters): NCCL's own IB transport, "
        "required (NCCL_NET=IB: no silent fall-back to sockets); bootstrap on NCCL's default interfaces "
        "(ib* first); name the HCAs in slurm.env as an exact list (NCCL_IB_HCA: =mlx5_0,mlx5_1) where "
        "NCCL picks wrong ones",
        "NCCL's environment variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)",
        {"NCCL_NET": "IB", "NCCL_IB_DISABLE": "0", "GLOO_SOCKET_IFNAME": "ib0"},
        networks=("IB", "IBext"),
        missing="no usable InfiniBand device (is /dev/infiniband there, in the container too: pyxis and enroot "
                "mount it with the NVIDIA hooks; does NCCL_IB_HCA name this node's HCAs, ibv_devices?)",
        clues=("NET/IB", "WARN")),
    "tcp": Fabric(
        "plain TCP sockets (Ethernet without RDMA): slow, for bring-up and CPU clusters",
        "NCCL's environment variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)",
        {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"},
        networks=("Socket",)),
}

ALWAYS = {"NCCL_DEBUG": "VERSION"}
LL128_FROM = (2, 27)  # slingshot: NCCL from this release on runs with NCCL_PROTO=^LL128 (CSCS)


def fabric_env(name: str | None, env: dict[str, str], runtime: str | None = None) -> dict[str, str]:
    """What a job exports: the profile's variables (less those a Container Engine hook sets, under
    runtime `ce`), NCCL_DEBUG=VERSION, then the matrix's env over both. `name` is one of FABRICS or
    None (not chosen: as `none`)."""
    fabric = FABRICS[name or "none"]
    own = {k: v for k, v in fabric.env.items() if not (runtime == "ce" and k in fabric.hook_sets)}
    return {**own, **ALWAYS, **env}


def left_to_hook(name: str | None, env: dict[str, str], runtime: str | None) -> list[str]:
    """The profile's variables the job does not export because the Container Engine's hook sets them."""
    fabric = FABRICS[name or "none"]
    return sorted(k for k in fabric.env if runtime == "ce" and k in fabric.hook_sets and k not in env)


def launch_env(name: str | None, environ: dict[str, str], nccl_version: tuple[int, ...] | None) -> dict[str, str]:
    """Variables the launcher adds on the node, where the fabric needs what only the node knows:
    slingshot's NCCL_PROTO=^LL128 for NCCL >= 2.27 (unless set)."""
    if name == "slingshot" and "NCCL_PROTO" not in environ and nccl_version and tuple(nccl_version) >= LL128_FROM:
        return {"NCCL_PROTO": "^LL128"}
    return {}


# ---- which network NCCL chose, from its NCCL_DEBUG=INFO lines ----

# "NCCL INFO Using network IB" (init), "... via NET/IB/0" (a channel's connection), and the plugin's
# own "NET/OFI ..." lines.
USING = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.MULTILINE)
VIA = re.compile(r"\bvia NET/([^/\s]+(?: [^/\s]+)?)/", re.MULTILINE)
OFI = re.compile(r"NCCL INFO NET/OFI\b", re.MULTILINE)
# Why a network is missing: NCCL's own words, kept for the failure line.
WHY = re.compile(r"(NET/IB : No device found\.?|NET/Plugin\s*:.*(?:No plugin found|Plugin load returned|"
                 r"Could not find|Failed to find|cannot open shared object file)[^\n]*|"
                 r"NCCL WARN [^\n]*(?:network|NET|IB)[^\n]*)")


@dataclass(frozen=True)
class Transport:
    network: str | None  # as NCCL names it: IB, Socket, AWS Libfabric; None: not in the log
    via_net: bool  # a channel ran across nodes over it (a "via NET/..." line)
    notes: tuple[str, ...] = ()  # NCCL's words on what it did not find

    @property
    def label(self) -> str:
        if self.network is None:
            return "unknown (no NCCL INFO network line)"
        return f"NET/{self.network}" + ("" if self.via_net else " (no channel across nodes)")


def nccl_transport(text: str) -> Transport:
    """The network NCCL chose, from NCCL_DEBUG=INFO output (one rank's, or several concatenated): the
    "via NET/X" of a channel across nodes first, else "Using network X"; a loaded OFI plugin names
    itself "AWS Libfabric" (or "Libfabric") there."""
    via = VIA.findall(text)
    using = USING.findall(text)
    network = via[0] if via else using[0] if using else ("AWS Libfabric" if OFI.search(text) else None)
    notes = tuple(dict.fromkeys(m.strip() for m in WHY.findall(text)))
    return Transport(network.strip() if network else None, bool(via), notes[:3])


def transport_problem(fabric: str | None, transport: Transport) -> tuple[str, str] | None:
    """(what NCCL chose, the fix) when the network does not fit the matrix's fabric; None when it fits
    (or the fabric takes any, or the log named none)."""
    profile = FABRICS[fabric or "none"]
    if not profile.networks or transport.network is None:
        return None
    if any(transport.network == n or transport.network.startswith(n + "_") for n in profile.networks):
        return None
    notes = [n for n in transport.notes if not profile.clues or any(c in n for c in profile.clues)]
    why = f" ({'; '.join(notes)})" if notes else ""
    return (f"NCCL chose NET/{transport.network} under fabric {fabric}{why}",
            profile.missing or "set slurm.fabric to the network this cluster has")


# ---- the matrix's env, checked before anything runs ----

def hca_problem(env: dict[str, str]) -> str | None:
    """NCCL_IB_HCA names HCAs by prefix unless the list starts with '=' ('^=' to exclude exactly):
    'mlx5_1' also takes mlx5_10 .. mlx5_19. A list of numbered HCAs without '=' is one line naming
    the fix."""
    value = env.get("NCCL_IB_HCA", "")
    if not value or value.startswith(("=", "^=")):
        return None
    names = [n.split(":")[0] for n in value.lstrip("^").split(",")]
    if short := [n for n in names if re.fullmatch(r".*_[1-9]", n)]:  # mlx5_1 is a prefix of mlx5_10 .. mlx5_19
        exact = ("^=" if value.startswith("^") else "=") + value.lstrip("^")
        return (f"NCCL_IB_HCA={value}: NCCL matches each name as a prefix ({short[0]} also takes {short[0]}0, "
                f"{short[0]}1, ... on a node with ten HCAs or more): write {exact} for exactly these")
    return None
