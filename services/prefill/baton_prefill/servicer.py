"""``PrefillService``: prefill a prompt, sample its first token, hold its KV under a lease.

The engine runs the request prefill-only (``EngineCore.add_request(prefill_only=True)``): it is
batched with other prompts under the token budget, shares cached prefixes, samples the first
token with the request's own sampling parameters, and ends with its prompt's blocks held. The
answer carries the first token and a ``KVHandle``; the blocks stay held until the decode worker
releases the lease after its pull, the lease expires, or the request is aborted (``Abort``), and
then the engine frees them. A first token that already ends the request (EOS, a stop token,
``max_tokens`` 1) frees the blocks at once and returns no handle.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from baton import tracing
from baton.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from baton_decode import codec
from baton_decode.engine_loop import EngineLoop
from baton_decode.server import WorkerInfoMixin, status_code
from baton_engine.errors import BatonError, InvalidRequestError
from baton_engine.kv_cache.hashing import hash_request_tokens, prefix_root
from baton_kvtransfer.handle import KVHandle
from baton_kvtransfer.leases import LeaseTable

logger = logging.getLogger(__name__)


class PrefillServicer(WorkerInfoMixin, engine_pb2_grpc.PrefillServiceServicer):
    """``PrefillService`` over one ``EngineLoop``; every method runs on the asyncio loop."""

    def __init__(
        self,
        engine: EngineLoop,
        leases: LeaseTable,
        *,
        worker_id: str,
        engine_id: str,
        epoch: int,
        transfer_endpoint: str,
        compat_hash: bytes,
        served_model_name: str,
        metrics_url: str,
    ) -> None:
        self.engine = engine
        self.leases = leases
        self.worker_id = worker_id
        self.engine_id = engine_id
        self.epoch = epoch
        self.transfer_endpoint = transfer_endpoint
        self.compat_hash = compat_hash
        self.served_model_name = served_model_name
        self.metrics_url = metrics_url
        self.block_size = engine.core.config.block_size
        self.draining = False

    async def Prefill(
        self, request: engine_pb2.PrefillRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.PrefillResponse:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        span = tracing.start_span(
            "prefill worker",
            tracing.extract(context.invocation_metadata()),
            tracing.SpanKind.SERVER,
            {
                "baton.req_id": request.req_id,
                "baton.prompt_tokens": len(request.prompt_token_ids)
                or (list(request.prompt_embeds.shape) or [0])[0],
            },
        )
        try:
            return await self._prefill(request, context, span)
        finally:
            tracing.end_span(span)

    async def _prefill(
        self,
        request: engine_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        span: tracing.Span,
    ) -> engine_pb2.PrefillResponse:
        try:
            params = codec.sampling_params_from_proto(request.sampling)
            prompt = list(request.prompt_token_ids)
            embeds = None
            if request.HasField("prompt_embeds"):
                embeds = codec.prompt_embeds_from_proto(request.prompt_embeds, prompt)
                embeds, prompt = await asyncio.to_thread(self.engine.core.embeds_prompt, embeds)
            req_id = request.req_id
            if not req_id:
                raise InvalidRequestError("req_id is required (the gateway aborts by it)")
            await self.engine.compile_grammar(params)
            stream = self.engine.add_request(
                req_id,
                prompt,
                params,
                prefill_only=True,
                priority=request.priority,
                lora_name=request.lora_name,
                cache_salt=request.cache_salt or None,
                prompt_embeds=embeds,
            )
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        finished = False
        try:
            outputs = []
            while not finished:
                try:
                    outputs += await stream.next_batch()
                except BatonError as e:
                    finished = True
                    await context.abort(status_code(e), str(e))
                finished = outputs[-1].finish_reason is not None
        finally:
            if not finished:  # the call was cancelled: nobody will take the prompt's KV
                self.engine.abort([req_id])
                # It may have finished already, its output waiting unread: free what it holds.
                self.engine.release_held([req_id])
        out = outputs[-1]
        span.set_attribute("baton.cached_tokens", max(out.num_cached_tokens, 0))
        if out.finish_reason == "abort":
            await context.abort(grpc.StatusCode.ABORTED, "the request was aborted")
        first = out.new_token_ids[0]
        msg = engine_pb2.PrefillResponse(
            first_token_id=first, num_cached_tokens=max(out.num_cached_tokens, 0)
        )
        if out.new_logprobs:
            msg.first_token_logprobs.CopyFrom(codec.token_logprobs_to_proto(out.new_logprobs[0]))
        if out.finish_reason != "prefilled":  # the first token ended it: nothing is held
            msg.finish_reason = codec.FINISH_REASONS[out.finish_reason]  # type: ignore[index]
            return msg
        assert out.kv_block_ids is not None
        lease = self.leases.grant(req_id, out.kv_block_ids)
        handle = KVHandle(
            worker_id=self.worker_id,
            engine_id=self.engine_id,
            epoch=self.epoch,
            transfer_endpoint=self.transfer_endpoint,
            block_ids=tuple(out.kv_block_ids),
            block_hashes=tuple(
                h.hash_value
                for h in hash_request_tokens(
                    prompt,
                    self.block_size,
                    root=prefix_root(request.lora_name or None, request.cache_salt or None),
                )
            ),
            num_tokens=len(prompt),
            lease_id=lease.lease_id,
            lease_expiry_unix_ms=lease.expiry_unix_ms,
            compat_hash=self.compat_hash,
        )
        msg.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        msg.kv_handle.CopyFrom(codec.kv_handle_to_proto(handle))
        if context.cancelled():  # nobody will pull it
            self.leases.release_request(req_id)
        return msg

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.AbortResponse:
        """Abort prefills in progress and release the leases of finished ones."""
        req_ids = list(request.req_ids)
        num = self.engine.abort(req_ids)
        num += sum(self.leases.release_request(req_id) for req_id in req_ids)
        return engine_pb2.AbortResponse(num_aborted=num)
