"""The attribute-name reading of a model's facts, used only to cross-check what the graph shows (facts.py).

`resolve` keeps the graph's value for each fact, and records as one sentence for ModelIR.warnings each
disagreement with the usual config / attribute names (n_head, num_attention_heads, ...), each fact the graph
does not show, and each parameter no captured op reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import nn

from mlm.planner.capture.facts import AttentionSite, GraphFacts

UNKNOWN_HEADS = 1  # what the IR records when no attention op is found: tp cannot divide 1 head, so tp stays 1


@dataclass(frozen=True)
class Facts:
    """The facts ModelIR carries, with the sentences that explain each assumption or disagreement."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    attention_kinds: tuple[str, ...]
    warnings: tuple[str, ...]


ATTRIBUTE_NAMES = {
    "hidden_size": ("n_embd", "hidden_size", "dim", "d_model", "embed_dim"),
    "num_heads": ("n_head", "num_attention_heads", "n_heads", "num_heads"),
    "num_kv_heads": ("n_kv_heads", "num_key_value_heads", "n_kv_head", "num_kv_heads"),
    "head_dim": ("head_dim", "d_kv", "head_size"),
    "vocab_size": ("vocab_size", "n_vocab"),
    "context": ("block_size", "n_positions", "max_position_embeddings", "max_seq_len", "seq_len", "n_ctx"),
}


class Attribute(NamedTuple):
    """One fact as attributes state it: the first name found, and every other name on the same object that states
    the same fact (configs can carry two names that disagree, e.g. FalconConfig's num_kv_heads and
    num_key_value_heads under multi_query)."""

    value: int
    name: str
    others: tuple[tuple[int, str], ...] = ()


def attribute_facts(model: nn.Module) -> dict[str, Attribute]:
    """Each fact's value from the usual config/attribute names, with the name it came from (config first)."""
    cfg = getattr(model, "config", None)
    sources = [("config", cfg), *model.named_modules()]
    found: dict[str, Attribute] = {}
    for fact, names in ATTRIBUTE_NAMES.items():
        for where, source in sources:
            if source is None:
                continue
            hits = [name for name in names if _positive_int(getattr(source, name, None))]
            if hits:
                prefix = "config" if where == "config" else (where or "model")
                stated = [(getattr(source, name), f"{prefix}.{name}") for name in hits]
                found[fact] = Attribute(*stated[0], tuple(stated[1:]))
                break
    return found


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def resolve(
    graph: GraphFacts, attrs: dict[str, Attribute], embedding_dim: int | None, token_inputs: bool = True
) -> Facts:
    """The graph's facts, the attributes as a cross-check, and one sentence per gap or disagreement (no word on a
    vocabulary where the inputs are not tokens: an image model has none)."""
    notes: list[str] = []
    site = _representative(graph.attention, notes)
    if site is None:
        heads, kv, head_dim = UNKNOWN_HEADS, UNKNOWN_HEADS, 0
        said = attrs.get("num_heads")
        hint = f" (attribute {said[1]} = {said[0]} was not used)" if said else ""
        notes.append(
            "no attention op (scaled_dot_product_attention or matmul-softmax-matmul) found in the captured graph: "
            f"heads unknown{hint}, recorded as {UNKNOWN_HEADS} so tensor parallelism will not split attention"
        )
    else:
        heads, head_dim = site.heads, site.head_dim
        kv = site.kv_heads
        where = f"the {site.how} in {site.layer or 'the model'}"
        if kv < 1 or heads % kv:
            notes.append(f"kv heads could not be read from the key of {where}: assumed equal to the {heads} heads")
            kv = heads
        _cross_check("num_heads", heads, f"query of {where}", attrs, notes)
        _cross_check("num_kv_heads", kv, f"key of {where} before any repeat/expand", attrs, notes)
        _cross_check("head_dim", head_dim, f"query of {where}", attrs, notes)
    hidden = graph.hidden
    if hidden is None:
        fallback = embedding_dim or attrs.get("hidden_size", (0, ""))[0]
        notes.append(f"hidden size not found from a block input in the graph: using {fallback}")
        hidden = fallback
    else:
        _cross_check("hidden_size", hidden, graph.hidden_from, attrs, notes)
    vocab = _vocab(graph, attrs, notes if token_inputs else [])
    if graph.unused_params:
        listed = ", ".join(name for name, _ in graph.unused_params[:4])
        more = f" and {len(graph.unused_params) - 4} more" if len(graph.unused_params) > 4 else ""
        total = sum(n for _, n in graph.unused_params)
        notes.append(
            f"{len(graph.unused_params)} parameters ({total:,} elements: {listed}{more}) take part in no captured "
            f"op: they are counted in the model's size but their compute is not costed (e.g. MoE experts the "
            f"captured routing never reached)"
        )
    kinds = tuple(dict.fromkeys(s.kind for s in graph.attention))
    return Facts(hidden, heads, kv, head_dim, vocab, kinds, tuple(notes))


def _representative(sites: tuple[AttentionSite, ...], notes: list[str]) -> AttentionSite | None:
    """The first self-attention site (else the first site); a differing head layout elsewhere is noted."""
    if not sites:
        return None
    site = next((s for s in sites if s.is_self_attention), sites[0])
    shapes = {(s.heads, s.kv_heads, s.head_dim) for s in sites}
    if len(shapes) > 1:
        listed = "; ".join(f"{s.layer or s.module}: {s.heads}/{s.kv_heads} heads x {s.head_dim}" for s in sites[:6])
        notes.append(
            f"attention ops differ in heads/kv heads/head_dim ({listed}): planned with the first self-attention "
            f"({site.heads}/{site.kv_heads} x {site.head_dim})"
        )
    return site


def _cross_check(fact: str, value: int, source: str, attrs: dict[str, Attribute], notes: list[str]) -> None:
    said = attrs.get(fact)
    if said is None:
        return
    label = fact.replace("num_", "").replace("_", " ")
    for stated, name in ((said.value, said.name), *said.others):
        if stated != value:
            notes.append(
                f"{label}: the graph gives {value} ({source}) but attribute {name} says {stated}; the graph's value "
                f"is used"
            )


def _vocab(graph: GraphFacts, attrs: dict[str, Attribute], notes: list[str]) -> int:
    vin, vout = graph.vocab_in, graph.vocab_out
    if vin is not None and vout is not None and vin != vout:
        notes.append(f"the token embedding has {vin} rows but the output projection {vout} columns: vocabulary {vout}")
    vocab = vout or vin
    if vocab is None:
        said = attrs.get("vocab_size")
        notes.append(
            "no token embedding or cross-entropy output projection found in the graph: vocabulary unknown"
            + (f" (attribute {said[1]} = {said[0]} not used)" if said else "")
        )
        return 0
    _cross_check("vocab_size", vocab, "the embedding / output projection", attrs, notes)
    return vocab
