"""The streaming workload's decoder behind LitServe's OpenAI spec (runs in the LitServe venv).

A GPT-2-architecture checkpoint (built by bench.streaming) generates greedily
with a KV cache. Requests LitServe batches together (``max_batch_size``,
``batch_timeout``) are generated as one static batch, left-padded: each step
yields one text piece per request, until every request has its
``max_tokens`` (EOS is ignored, as the aserve side is asked to). The prompt
is the messages' contents joined, as the chat template on the aserve side.
"""

from __future__ import annotations

import os

import common
import litserve as ls
import torch


class LMAPI(ls.LitAPI):
    def setup(self, device):
        from tokenizers import Tokenizer
        from transformers import GPT2LMHeadModel

        common.set_threads()
        folder = os.environ["BENCH_LM_DIR"]
        self.tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.model = GPT2LMHeadModel.from_pretrained(folder).eval()

    def decode_request(self, request):
        prompt = "".join(str(m.content) for m in request.messages)
        return prompt, int(request.max_tokens or 16)

    def batch(self, inputs):
        return list(inputs)

    def unbatch(self, output):
        return output

    def predict(self, inputs):
        single = not isinstance(inputs, list)
        items = [inputs] if single else inputs
        for pieces in self._generate(items):
            yield pieces[0] if single else pieces

    def encode_response(self, outputs):
        for step in outputs:
            if isinstance(step, list):
                yield [{"role": "assistant", "content": p} for p in step]
            else:
                yield {"role": "assistant", "content": step}

    @torch.inference_mode()
    def _generate(self, items):
        ids = [self.tok.encode(p).ids for p, _ in items]
        limits = [n for _, n in items]
        width = max(len(x) for x in ids)
        pad = 0
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past = None
        for step in range(max(limits)):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            nxt = out.logits[:, -1, :].argmax(-1)
            yield [
                self.tok.decode([int(t)]) if step < n else ""
                for t, n in zip(nxt.tolist(), limits, strict=True)
            ]
            input_ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1


def litserve_api(max_batch: int, batch_timeout: float) -> LMAPI:
    return LMAPI(max_batch_size=max_batch, batch_timeout=batch_timeout, spec=ls.OpenAISpec())
