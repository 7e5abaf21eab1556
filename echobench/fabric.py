"""Fabric profiles: named sets of NCCL / libfabric settings for a cluster's interconnect.

None is applied unless a matrix chooses one (`slurm.fabric`), because a wrong one fails at NCCL's
start (an interface that does not exist) or runs slowly over sockets; the matrix's own `slurm.env`
overrides any variable of a profile. Every job sets NCCL_DEBUG=VERSION (unless the matrix sets
NCCL_DEBUG), so its log names the NCCL that ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fabric:
    what: str
    source: str
    env: dict[str, str] = field(default_factory=dict)


FABRICS: dict[str, Fabric] = {
    "none": Fabric("nothing set: NCCL's own choices (right on a single node, and where the cluster's "
                   "modules set the variables)", "-"),
    "slingshot": Fabric(
        "HPE Slingshot 11 (quad-GH200 systems such as Alps, Isambard-AI, Olivia): NCCL through the "
        "aws-ofi-nccl plugin and libfabric's cxi provider; the plugin must be on the nodes (often a "
        "module: load it in slurm.setup)",
        "Isambard-AI's NCCL guide (docs.isambard.ac.uk/user-documentation/guides/nccl) and HPE's "
        "shs-ccl-docs ccl_env.sh (what Olivia's NCCL modules set)",
        {"NCCL_NET": "AWS Libfabric", "NCCL_SOCKET_IFNAME": "hsn", "NCCL_NET_GDR_LEVEL": "PHB",
         "NCCL_CROSS_NIC": "1", "FI_CXI_DEFAULT_CQ_SIZE": "131072", "FI_CXI_DISABLE_HOST_REGISTER": "1",
         "FI_MR_CACHE_MONITOR": "userfaultfd"}),
    "infiniband": Fabric(
        "InfiniBand (x86 H100 / H200 HGX clusters): NCCL's own IB transport, bootstrap over any "
        "interface but loopback and docker; name the HCAs in slurm.env (NCCL_IB_HCA) where NCCL picks wrong ones",
        "NCCL's environment variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)",
        {"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "^lo,docker0"}),
    "tcp": Fabric(
        "plain TCP sockets (Ethernet without RDMA): slow, for bring-up and CPU clusters",
        "NCCL's environment variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)",
        {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "^lo,docker0"}),
}

ALWAYS = {"NCCL_DEBUG": "VERSION"}


def fabric_env(name: str, env: dict[str, str]) -> dict[str, str]:
    """What a job exports: the profile's variables, NCCL_DEBUG=VERSION, then the matrix's env over both
    (`name` is one of FABRICS: the matrix's slurm.fabric admits no other)."""
    return {**FABRICS[name].env, **ALWAYS, **env}
