"""The unpadded ("varlen") forward of BERT-layout encoders: a batch's real tokens packed into one
(tokens, hidden) tensor, so that the embeddings, every linear layer, LayerNorm and activation run
on real tokens only, and attention runs per sequence from cumulative sequence lengths.

Padding is what a padded batch computes for nothing: every linear layer (QKV, output, FFN,
most of an encoder's FLOPs) runs on it. At CUDA's large token budgets a batch still carries
about 11% padding after the planner's padding rule (`MAX_BATCH_PADDING`).

Attention kernels (`attention_kernel`):
- `varlen`: `torch.nn.attention.varlen.varlen_attn` (FlashAttention or cuDNN on packed
  tokens), CUDA in float16/bfloat16 only;
- `padded`: the packed q, k and v scattered back into (rows, heads, length, head size) for
  `scaled_dot_product_attention` with the padding mask, and gathered again: on the CPU, and
  for float32 on CUDA (FlashAttention takes half precision only). SDPA on a nested jagged
  tensor runs on the CPU too, but measured slower there than this (MiniLM, 2 threads: 639 ms
  against 310 ms for 16 rows of 100-128 tokens; docs/performance.md).

Supported: BertModel, RobertaModel and XLMRobertaModel (and their ForSequenceClassification),
whose layers share one layout; anything else keeps the padded forward (`unpadding_refusal`
says why). Which forward a run uses is settled by `settle_unpad` (`--unpad`).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

log = logging.getLogger(__name__)

ENCODER_CLASSES = {"BertModel": "bert", "RobertaModel": "roberta", "XLMRobertaModel": "xlm-roberta"}
CLASSIFIER_CLASSES = {"BertForSequenceClassification": "bert", "RobertaForSequenceClassification": "roberta",
                      "XLMRobertaForSequenceClassification": "xlm-roberta"}
ROBERTA_POSITIONS = ("roberta", "xlm-roberta")  # positions count from padding_idx + 1, as fairseq's do


def cumulative_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """(rows + 1,) int32 offsets of each row's tokens in the packed tensor: 0, l0, l0 + l1, …"""
    return torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def layer_refusal(layer) -> str | None:
    """Why a layer does not have BERT's layout (None: it has)."""
    needed = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
              "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
    for path in needed:
        module = layer
        for name in path.split("."):
            module = getattr(module, name, None)
        if module is None:
            return f"its layers have no {path}"
    if getattr(layer, "chunk_size_feed_forward", 0):
        return "its feed-forward runs in chunks"
    if not callable(getattr(layer.intermediate, "intermediate_act_fn", None)):
        return "its feed-forward has no activation function"
    return None


def encoder_refusal(encoder) -> str | None:
    """Why `encoder` cannot run unpadded (None: it can): only the BERT layout, as an encoder
    (no decoder, no cross-attention), with absolute positions."""
    name = type(encoder).__name__
    config = encoder.config
    if ENCODER_CLASSES.get(name) != getattr(config, "model_type", None):
        return f"{name} ({getattr(config, 'model_type', None)}) is not one of {', '.join(ENCODER_CLASSES)}"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return f"{name} is configured as a decoder"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"{name} uses {config.position_embedding_type} positions"
    embeddings = getattr(encoder, "embeddings", None)
    if embeddings is None or not all(hasattr(embeddings, part) for part in (
            "word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm")):
        return f"{name}'s embeddings are not BERT's (word, position, token type, LayerNorm)"
    layers = getattr(getattr(encoder, "encoder", None), "layer", None)
    if not layers:
        return f"{name} has no encoder.layer list"
    refusal = next((why for why in map(layer_refusal, layers) if why), None)
    return f"{name}: {refusal}" if refusal else None


def attention_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """`varlen` (FlashAttention/cuDNN on packed tokens) on CUDA in half precision, where torch
    has it; else `padded` (SDPA on the batch padded again inside attention alone), which runs
    on any device and dtype."""
    if (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("torch.nn.attention.varlen") is not None):  # torch ≥ 2.10
        return "varlen"
    return "padded"


def runs_unpadded(model) -> bool:
    """Whether `settle_unpad` gave `model` an unpadded forward: its padded batches then travel with
    their packed layout (`pipeline.core.collate.packed_layout`)."""
    return getattr(model, "unpadded", None) is not None


class PackedBatch:
    """Where a padded batch's real tokens are: their flat positions in (rows × length), each
    row's offsets in the packed tensor, and the padded shape to scatter results back into.
    `packing`: those positions and offsets as the host built them with the batch
    (`packed_layout`); without it they are read from the mask, which waits for the device (a
    sync): only a batch collated without them (an online request, a part split off after an
    out-of-memory error, a test) pays that."""

    def __init__(self, attention_mask: torch.Tensor, packing: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.rows, self.length = attention_mask.shape
        if packing is not None:
            self.indices, self.offsets = packing
        else:
            self.indices = attention_mask.reshape(-1).bool().nonzero().squeeze(1)  # row-major, each row's in order
            self.offsets = cumulative_lengths(attention_mask.bool().sum(dim=1))
        self.key_mask = attention_mask.bool()[:, None, None, :]  # for attention on the batch padded again

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        """(rows, length, …) from (tokens, …), zeros at padding."""
        out = packed.new_zeros((self.rows * self.length, *packed.shape[1:]))
        out[self.indices] = packed
        return out.view(self.rows, self.length, *packed.shape[1:])


class UnpaddedEncoder:
    """Runs a BERT-layout encoder's modules on packed tokens. Not a module of its own: it reads
    the encoder's weights where they are, so nothing is copied."""

    def __init__(self, encoder: torch.nn.Module, kernel: str):
        self.encoder = encoder
        self.kernel = kernel
        self.model_type = encoder.config.model_type
        self.name = type(encoder).__name__

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(rows, length) position ids as the model's own embeddings compute them."""
        if self.model_type in ROBERTA_POSITIONS:
            padding_idx = self.encoder.embeddings.padding_idx
            kept = input_ids.ne(padding_idx).int()
            return (torch.cumsum(kept, dim=1).type_as(kept) * kept).long() + padding_idx
        return self.encoder.embeddings.position_ids[:, :input_ids.shape[1]].expand_as(input_ids)

    def embed(self, input_ids: torch.Tensor, batch: PackedBatch,
              token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(tokens, hidden) embeddings of the real tokens, each at its own position and token type
        (type 0 for every token without `token_type_ids`, as the model's own forward takes it)."""
        embeddings = self.encoder.embeddings
        positions = self.positions(input_ids).reshape(-1)[batch.indices]
        states = embeddings.word_embeddings(input_ids.reshape(-1)[batch.indices])
        types = torch.zeros_like(positions) if token_type_ids is None else token_type_ids.reshape(-1)[batch.indices]
        states = states + embeddings.token_type_embeddings(types)
        states = states + embeddings.position_embeddings(positions)
        return embeddings.LayerNorm(states)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Each sequence's self-attention on packed (tokens, heads, head size) tensors."""
        if self.kernel == "varlen":
            from torch.nn.attention.varlen import varlen_attn

            # the padded length bounds every row's: an upper bound is all the kernel's grid needs, and
            # the host knows it without asking the device
            return varlen_attn(query, key, value, batch.offsets, batch.offsets, batch.length, batch.length)
        # SDPA on the batch padded again, for attention alone (its mask keeps each row to its own tokens)
        padded = [batch.padded(values).transpose(1, 2) for values in (query, key, value)]
        out = torch.nn.functional.scaled_dot_product_attention(*padded, attn_mask=batch.key_mask)
        return out.transpose(1, 2).reshape(batch.rows * batch.length, *query.shape[1:])[batch.indices]

    def layer(self, layer, states: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        attention = layer.attention.self
        heads, size = attention.num_attention_heads, attention.attention_head_size
        query, key, value = (projection(states).view(-1, heads, size)
                             for projection in (attention.query, attention.key, attention.value))
        context = self.attend(query, key, value, batch).reshape(states.shape[0], heads * size)
        output = layer.attention.output
        states = output.LayerNorm(output.dense(context) + states)
        hidden = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(states))
        return layer.output.LayerNorm(layer.output.dense(hidden) + states)

    def packed_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, packing=None,
                      token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, PackedBatch]:
        """(the last layer's (tokens, hidden) states of the real tokens, where they are)."""
        batch = PackedBatch(attention_mask, packing)
        states = self.embed(input_ids, batch, token_type_ids)
        for layer in self.encoder.encoder.layer:
            states = self.layer(layer, states, batch)
        return states, batch

    def last_hidden_state(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, packing=None) -> torch.Tensor:
        """(rows, length, hidden), as the padded forward's last_hidden_state at the real tokens
        (zeros at padding, which pooling leaves out)."""
        states, batch = self.packed_states(input_ids, attention_mask, packing)
        return batch.padded(states)

    def first_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, packing=None,
                     token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, 1, hidden): each row's first real token's state, what a classification head reads."""
        states, batch = self.packed_states(input_ids, attention_mask, packing, token_type_ids)
        return states[batch.offsets[:-1].long()].unsqueeze(1)


class UnpaddedClassifier:
    """A BERT-layout sequence classifier's logits from its encoder run unpadded: BERT's pooler
    (dense + tanh on the first token), dropout and classifier; RoBERTa's and XLM-R's head on
    the first token."""

    def __init__(self, model: torch.nn.Module, kernel: str):
        self.model = model
        self.encoder = UnpaddedEncoder(model.base_model, kernel)
        self.kernel, self.name = kernel, type(model).__name__

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, packing=None,
               token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        first = self.encoder.first_states(input_ids, attention_mask, packing, token_type_ids)
        if self.encoder.model_type == "bert":
            return self.model.classifier(self.model.dropout(self.model.base_model.pooler(first)))
        return self.model.classifier(first)


def classifier_refusal(model) -> str | None:
    """Why a sequence classifier cannot run unpadded (None: it can)."""
    name = type(model).__name__
    if CLASSIFIER_CLASSES.get(name) != getattr(model.config, "model_type", None):
        return f"{name} is not one of {', '.join(CLASSIFIER_CLASSES)}"
    if CLASSIFIER_CLASSES[name] == "bert" and getattr(model.base_model, "pooler", None) is None:
        return f"{name} has no pooler"
    return encoder_refusal(model.base_model)


def unpadded_forward(model, device: torch.device, dtype: torch.dtype):
    """(the unpadded forward for a job's loaded model, or None; why not): a SentenceEmbedder's
    encoder, a sequence classifier, or a Moderator's classifier."""
    kernel = attention_kernel(device, dtype)
    encoder = getattr(model, "encoder", None)
    if encoder is not None and hasattr(model, "recipe"):  # jobs.embed.SentenceEmbedder
        refusal = encoder_refusal(encoder)
        return (None, refusal) if refusal else (UnpaddedEncoder(encoder, kernel), None)
    classifier = model.classifier if hasattr(model, "thresholds") else model  # jobs.moderate.Moderator
    refusal = classifier_refusal(classifier)
    return (None, refusal) if refusal else (UnpaddedClassifier(classifier, kernel), None)


def agreement_batch(model, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows of 1, 5, 16 and 9 tokens (padded to 16) of ids the vocabulary holds."""
    vocab = getattr(model.config, "vocab_size", 1000)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(min(1000, vocab // 2), vocab, (4, 16), generator=generator)
    attention_mask = (torch.arange(16)[None, :] < torch.tensor([1, 5, 16, 9])[:, None]).long()
    return input_ids.to(device), attention_mask.to(device)


def agreement_types(job, model, attention_mask: torch.Tensor) -> dict:
    """For a pair job whose model has token types: the agreement batch's second half of each row
    typed 1, as a pair's second text is; else nothing."""
    if "pair" not in getattr(job, "inputs", ()) or getattr(model.config, "type_vocab_size", 1) < 2:
        return {}
    lengths = attention_mask.sum(dim=1, keepdim=True)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :]
    return {"token_type_ids": ((positions >= lengths // 2) & attention_mask.bool()).long()}


def settle_unpad(setting: str, job, model, device: torch.device, dtype: torch.dtype) -> str:
    """Settle `--unpad` for a loaded eager model: set `model.unpadded` (the unpadded forward the
    job's `forward` runs for padded batches) or leave it None; returns why, for the log and the
    summary. auto = on CUDA where the model qualifies, not on the CPU (measured slower there:
    docs/performance.md). A forward that qualifies must also agree with the padded one on a
    small padded batch (the job's strict test, as a compiled forward's), else it stays padded."""
    model.unpadded = None
    if setting == "off":
        return "padded: --unpad off"
    if setting == "auto" and device.type != "cuda":
        return "padded: --unpad auto on a CPU (the unpadded forward measured slower here)"
    forward, refusal = unpadded_forward(model, device, dtype)
    if forward is None:
        reason = f"padded: {refusal}"
        (log.warning if setting == "on" else log.info)(f"--unpad {setting}: {reason}")
        return reason
    input_ids, attention_mask = agreement_batch(model, device)
    types = agreement_types(job, model, attention_mask)
    try:
        with torch.inference_mode():
            padded = job.forward(model, input_ids, attention_mask, True, **types)
            model.unpadded = forward
            unpadded = job.forward(model, input_ids, attention_mask, True, **types)
    except Exception as error:  # noqa: BLE001 - a kernel missing on this device: the padded forward always runs
        model.unpadded = None
        log.warning(f"--unpad {setting}: the unpadded forward failed ({type(error).__name__}: {error}); padded")
        return f"padded: the unpadded forward failed ({type(error).__name__})"
    agrees, how = job.agreement(padded, unpadded, strict=True)
    if not agrees:
        model.unpadded = None
        log.warning(f"--unpad {setting}: the unpadded forward disagrees with the padded one ({how}); padded")
        return f"padded: the unpadded forward disagrees ({how})"
    return f"unpadded: {forward.name} on packed tokens, {forward.kernel} attention ({how})"
