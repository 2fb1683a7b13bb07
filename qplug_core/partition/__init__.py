"""Capability-based partitioning: group the nodes a backend supports and fuse them."""

from __future__ import annotations

from qplug_core.partition.fuse import fuse_by_partitions, stable_topological_sort
from qplug_core.partition.partitioner import CapabilityBasedPartitioner, Partition
from qplug_core.partition.support import (
    OperatorSupport,
    OperatorSupportBase,
    OpSupports,
    TensorDtypeRule,
    any_chain,
    chain,
    create_op_support,
)

__all__ = [
    "CapabilityBasedPartitioner", "OpSupports", "OperatorSupport", "OperatorSupportBase",
    "Partition", "TensorDtypeRule", "any_chain", "chain", "create_op_support",
    "fuse_by_partitions", "stable_topological_sort",
]
