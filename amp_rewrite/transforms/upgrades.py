"""Op upgrades painting needs: a v1 op that has no low-precision form becomes the op that has.

``FusedBatchNorm`` and ``FusedBatchNormGrad`` (v1) tie their statistics to ``T``; their V2 forms
add ``U`` for the statistics, so ``T`` can go to 16 bits while ``U`` stays float32. As grappler
does (``ConvertBatchNormOpsToV2``), each v1 node on the conversion's device becomes V2 with
``U=float32`` before painting; unlike grappler, a node whose ``T`` then stays float32 is put back
as it was, so a graph only changes where it is converted.
"""

from __future__ import annotations

from ..core.dtypes import FLOAT
from ..core.ir import Graph
from ..schema.opdefs import device_type, invalidate

_V2 = {"FusedBatchNorm": "FusedBatchNormV2", "FusedBatchNormGrad": "FusedBatchNormGradV2"}
_V1 = {v2: v1 for v1, v2 in _V2.items()}


def upgrade(graph: Graph, device: str) -> list[str]:
    """Turn the v1 batch norms placed on ``device`` into V2 (``U=float32``); their names."""
    done = []
    for node in graph.nodes():
        if node.op in _V2 and device in device_type(node, device):
            node.set_op(_V2[node.op])
            node.attr["U"].type = FLOAT
            invalidate(node)
            done.append(node.name)
    return done


def restore(graph: Graph, names: list[str]) -> None:
    """Put back as v1 the upgraded nodes whose ``T`` stayed float32."""
    for name in names:
        node = graph.node(name)
        if node.attr["T"].type == FLOAT:
            node.set_op(_V1[node.op])
            del node.attr["U"]
            invalidate(node)
