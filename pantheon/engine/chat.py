"""A validated chat request -> the GenerationRequest the engine runs: the prompt rendered in the
model's template (tools in the model's dialect), tokenized, and the constraints decided — which
tool grammar or JSON grammar (if any) each choice decodes under, and whether reasoning is split.

Nothing here is HTTP: the web layer calls `plan_chat` (off the event loop: rendering, tokenizing
and grammar compiles are CPU work) and renders what comes back."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

import numpy as np

from pantheon.config import no_think_default, tool_grammar
from pantheon.engine.events import GenerationRequest
from pantheon.engine.sampler import SamplingParams


class PlanError(ValueError):
    """The request cannot be rendered (bad tools, a template that rejects the messages)."""


class PromptOverBudget(Exception):
    """The prompt cannot fit the window: `tokens` (at least that many when `at_least`) >= kv_cap."""

    def __init__(self, tokens: int, kv_cap: int, at_least: bool = False):
        self.tokens, self.kv_cap, self.at_least = tokens, kv_cap, at_least
        n = f"at least {tokens}" if at_least else str(tokens)
        super().__init__(f"prompt of {n} tokens exceeds the available context size: kv_used={tokens} kv_cap={kv_cap}; "
                         "shorten the conversation")


_TEXT_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (longest, strips)


def _text_bound(tokenizer) -> tuple[int, bool] | None:
    """(the most bytes any one token stands for, whether special tokens strip whitespace), or None
    when the vocabulary allows no bound (SentencePiece without byte fallback fuses unknown runs)."""
    try:
        return _TEXT_BOUND[tokenizer]
    except KeyError:
        pass
    from pantheon.text.tokenizer import ATTR_LSTRIP, ATTR_RSTRIP

    n = tokenizer.vocab_size
    bound = None
    if not tokenizer.is_spm or all(tokenizer.token_to_id(f"<0x{b:02X}>") is not None for b in range(256)):
        longest = max(map(len, tokenizer.piece_table()), default=1) or 1
        strips = any(tokenizer.token_attr(i) & (ATTR_LSTRIP | ATTR_RSTRIP) for i in range(n))
        bound = (longest, strips)
    _TEXT_BOUND[tokenizer] = bound
    return bound


def min_prompt_tokens(tokenizer, text: str) -> int:
    """A lower bound on len(tokenizer.encode(text)) without tokenizing: each token stands for at
    most `longest` bytes and every character is at least one byte, so n characters need at least
    ceil(n / longest) tokens (whitespace a special token may strip is not counted). 0: no bound."""
    bound = _text_bound(tokenizer)
    if bound is None:
        return 0
    longest, strips = bound
    n = len(text)
    if strips:
        n -= sum(text.count(c) for c in " \t\n\v\f\r")  # what LSTRIP/RSTRIP may drop
    return -(-n // longest)


@dataclass
class ChatPlan:
    request: GenerationRequest
    response_format_status: str | None  # decided now, or None: decided from the outputs ("json")
    json_constrained: bool = False
    schema_downgraded: bool = False


def _sampling(chat, index: int) -> SamplingParams:
    return SamplingParams(
        temperature=chat.temperature, top_p=chat.top_p, top_k=chat.top_k,
        seed=None if chat.seed is None else chat.seed + index,
        presence_penalty=chat.presence_penalty, frequency_penalty=chat.frequency_penalty,
        logit_bias=chat.logit_bias, logprobs=chat.logprobs, top_logprobs=chat.top_logprobs if chat.logprobs else 0,
        min_p=chat.min_p, repetition_penalty=chat.repetition_penalty)


def tool_choice_required_with_thinking(engine) -> bool:
    """The think block stays unconstrained and the call is compelled after it: the Qwen XML and
    JSON dialects (their grammars model it), not MiniCPM's attribute dialect; never with the
    tool grammar off."""
    from pantheon.text.tools import MINICPM_XML

    return tool_grammar() != "off" and engine.tool_dialect is not MINICPM_XML


def raw_prompt_ids(engine, chat) -> list[int]:
    """A raw completion's prompt (no chat template): its token ids as given, or its text tokenized
    as llama.cpp does (special tokens parsed; BOS as the model says). With a suffix, a
    fill-in-the-middle prompt in the vocabulary's FIM tokens: [BOS] PRE prefix SUF suffix MID."""
    tok = engine.tokenizer
    if not isinstance(chat.prompt, str) and (bad := next((t for t in chat.prompt if not 0 <= t < tok.vocab_size),
                                                         None)) is not None:
        raise PlanError(f"prompt token id {bad} is outside the vocabulary [0, {tok.vocab_size})")
    if chat.suffix is None:
        if isinstance(chat.prompt, str):
            return tok.encode(chat.prompt, parse_special=True, add_bos=None if chat.add_special else False)
        return list(chat.prompt)
    if missing_fim_tokens(tok):
        raise PlanError("'suffix' needs fill-in-the-middle tokens, and this model's vocabulary has none")
    prefix = tok.encode(chat.prompt, parse_special=False, add_bos=False) if isinstance(chat.prompt, str) \
        else list(chat.prompt)
    return fim_prompt_ids(tok, prefix, tok.encode(chat.suffix, parse_special=False, add_bos=False))


def missing_fim_tokens(tok) -> list[str]:
    """The fill-in-the-middle tokens a prompt needs that the vocabulary lacks (prefix, suffix, middle)."""
    return [name for key, name in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
            if tok.special_id(key) is None]


def fim_prompt_ids(tok, prefix: list[int], suffix: list[int], middle: list[int] = (), extra: list[int] = ()) -> list[int]:
    """A fill-in-the-middle prompt as llama.cpp lays it out: extra context, [BOS] PRE prefix middle
    SUF suffix MID; the answer is what goes between prefix + middle and suffix."""
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    pre, suf, mid = (tok.special_id(k) for k in ("fim_pre", "fim_suf", "fim_mid"))
    return [*extra, *bos, pre, *prefix, *middle, suf, *suffix, mid]


def infill_ids(tok, prefix: str, suffix: str, chunks: list[tuple[str, str]], middle: list[int], batch: int,
               room: int) -> list[int]:
    """llama-server's /infill prompt (its repository-level pattern, arXiv 2409.12186): the extra
    files as [FIM_REP]myproject\\n then [FIM_SEP]filename\\n text each (without those tokens, each
    text after a "--- snippet ---" line), [FIM_SEP]filename\\n, then the FIM prompt of the prefix,
    `middle` (the start of the answer) and the suffix. As llama-server fits it: the prefix's last
    3/4 of a batch of tokens, the suffix's first quarter less the middle's, and of the extra
    context the last `room` tokens."""
    def text(s: str) -> list[int]:
        return tok.encode(s, parse_special=False, add_bos=False)

    rep, sep = tok.special_id("fim_rep"), tok.special_id("fim_sep")
    extra = [rep, *text("myproject\n")] if rep is not None else []
    for filename, body in chunks:
        extra += [sep, *text(filename + "\n")] if sep is not None else text("\n\n--- snippet ---\n\n")
        extra += text(body)
    if sep is not None:
        extra += [sep, *text("filename\n")]
    prefix_ids, suffix_ids = text(prefix), text(suffix)
    prefix_ids = prefix_ids[len(prefix_ids) - min(len(prefix_ids), 3 * (batch // 4)):]
    suffix_ids = suffix_ids[:max(0, batch // 4 - (2 + len(middle)))]
    extra = extra[len(extra) - min(len(extra), max(0, room)):]
    return fim_prompt_ids(tok, prefix_ids, suffix_ids, middle, extra)


def mixed_prompt_ids(tok, prompt, add_bos: bool | None = None) -> list[int]:
    """A llama-server prompt (text, ids, or both mixed) as ids: text tokenized with special tokens
    parsed and BOS as `add_bos` says (None: as the model says; only before leading text), as
    llama-server tokenizes; ids as they are."""
    pieces = [prompt] if isinstance(prompt, str) else prompt
    ids = []
    for k, piece in enumerate(pieces):
        ids += tok.encode(piece, parse_special=True, add_bos=add_bos if k == 0 else False) if isinstance(piece, str) \
            else [piece]
    return ids


def prefill_of(messages: list[dict], explicit: bool = False) -> str | None:
    """The text an assistant turn ending the conversation has begun, which the answer continues
    (Anthropic's prefill, llama-server's too; `continue_final_message` says so even of an empty
    one), or None: a final assistant message with text (or, `explicit`, any) and no tool calls."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    if last.get("role") == "assistant" and isinstance(content, str) and (content or explicit) \
            and not last.get("tool_calls"):
        return content
    return None


def through_final_message(text: str, messages: list[dict]) -> str:
    """`text`, a conversation rendered without the assistant's opening, cut where its final
    message's text ends, so the answer continues that message (transformers' and vLLM's
    `continue_final_message` of a turn that is not the assistant's)."""
    final = messages[-1].get("content") if messages else None
    end = text.rfind(final) if isinstance(final, str) and final else -1
    if end < 0:
        raise PlanError("continue_final_message: the chat template does not show the final message's text")
    return text[:end + len(final)]


def developer_as_system(engine, messages: list[dict]) -> list[dict]:
    """OpenAI's `developer` turns (its newer clients' system prompt) as `system` ones, as llama.cpp
    maps them, except for a template with a developer role of its own (GPT-OSS's harmony channels)."""
    source = engine.template.source if engine.template is not None else ""
    if "<|channel|>" in source or not any(m.get("role") == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def render_prompt(engine, chat, add_generation_prompt: bool = True) -> tuple[str, dict, object, list | None, bool]:
    """The chat's prompt text in the model's template, with tools in its dialect (and the assistant's
    opening, unless told not to; a prefill continues it): (text, the template's kwargs, dialect,
    tool specs, whether tools are on)."""
    from pantheon.text.chat_template import ChatTemplateError, fold_system_turns
    from pantheon.text.tools import ToolSpecError, apply_dialect, normalize_tools, schema_problem

    tools_on = bool(chat.tools) and chat.tool_choice != "none"
    messages, dialect, specs = developer_as_system(engine, chat.messages), None, None
    # A final assistant turn is continued (llama-server's prefill; continue_final_message), else the
    # assistant's opening follows; the request's add_generation_prompt false (vLLM's) renders the
    # conversation as it is, and so does the caller's (a conversation's head).
    explicit = chat.continue_final_message
    ask = add_generation_prompt and (chat.add_generation_prompt or explicit)
    prefill = prefill_of(messages, explicit) if ask else None
    opening = ask and (prefill is not None or chat.add_generation_prompt)
    cut = ask and explicit and prefill is None
    if prefill is not None:  # the conversation up to the assistant's opening, then the text it has begun
        messages = messages[:-1]
    try:
        if tools_on:
            dialect, specs = engine.tool_dialect, normalize_tools(chat.tools)
            for spec in specs:
                if problem := schema_problem(spec.parameters, "parameters"):
                    raise ToolSpecError(f"tool {spec.name!r}: {problem}")
        if tools_on or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages = apply_dialect(engine.tool_dialect, messages, specs if tools_on else None)
    except ToolSpecError as e:
        raise PlanError(f"invalid tools: {e}") from None

    kwargs = dict(chat.template_kwargs)
    if engine.think:
        kwargs["enable_thinking"] = chat.enable_thinking if chat.enable_thinking is not None else not no_think_default()
    def render(turns):
        return engine.render_chat(turns, add_generation_prompt=opening, **kwargs) + (prefill or "")

    try:
        text = render(messages)
    except ChatTemplateError as e:
        # A template that refuses the messages may take them with their system turns folded into user
        # turns: those after the first (it takes a system turn only first), then all (it takes none).
        text = None
        for keep_first in (True, False):
            if (folded := fold_system_turns(messages, keep_first)) is not messages:
                try:
                    text = render(folded)
                    break
                except ChatTemplateError:
                    pass
        if text is None:
            raise PlanError(f"chat template rejected the messages: {e}") from None
    if cut:
        text = through_final_message(text, messages)
    return text, kwargs, dialect, specs, tools_on


def count_prompt_tokens(engine, chat) -> int:
    """The prompt's length in tokens, as a request would prefill it (Anthropic's count_tokens)."""
    return len(engine.encode_prompt(render_prompt(engine, chat)[0]))


@dataclass
class _Prompt:
    """A request's prompt as the engine will run it, and what the template decided about it."""

    ids: list[int]
    kwargs: dict = field(default_factory=dict)  # the template's arguments (enable_thinking, ...)
    dialect: object = None  # the tool-call dialect, when tools were rendered
    specs: list | None = None  # the tools' specs
    tools_on: bool = False
    think: bool = False  # the model thinks (a reasoning template)
    start_in_reasoning: bool = False  # the template already opened the think block
    text: str = ""  # the rendered prompt (a chat's; "" for a raw prompt)

    @property
    def think_rule(self) -> str:
        """What a grammar lets come before its constrained part: an open think block to close
        first, an optional one, or none."""
        if self.start_in_reasoning:
            return "open"
        return "optional" if self.think and self.kwargs.get("enable_thinking") else "none"


def _prompt(engine, chat, window: int | None) -> _Prompt:
    """Render and tokenize; with window, refuse a prompt that cannot fit (len >= window) as soon as
    that is known: before tokenizing when the rendered text alone is too long, else right after."""
    if getattr(chat, "prompt", None) is not None:  # raw text or ids (the completions API)
        ids = raw_prompt_ids(engine, chat)
        if not ids:
            raise PlanError("the prompt is empty")
        if window is not None and len(ids) >= window:
            raise PromptOverBudget(len(ids), window)
        return _Prompt(ids)
    text, kwargs, dialect, specs, tools_on = render_prompt(engine, chat)
    if window is not None and (at_least := min_prompt_tokens(engine.tokenizer, text)) >= window:
        raise PromptOverBudget(at_least, window, at_least=True)
    ids = engine.encode_prompt(text)
    if window is not None and len(ids) >= window:
        raise PromptOverBudget(len(ids), window)
    think = engine.think
    return _Prompt(ids, kwargs, dialect, specs, tools_on, think, think and text.rstrip().endswith("<think>"), text)


@dataclass
class _Format:
    """What response_format asks of the output: a grammar, or a status decided now."""

    grammar: object = None
    status: str | None = None  # decided now, or None: decided from the outputs
    json_constrained: bool = False
    downgraded: bool = False  # a schema the grammar could only follow as any JSON object


def _response_format(engine, rf: dict | None, prompt: _Prompt) -> _Format:
    if rf is None:
        return _Format()
    kind, factory, rule = rf.get("type"), engine.grammar_factory, prompt.think_rule
    if prompt.tools_on:
        return _Format(status="ignored_tools_present")
    if kind == "text":
        return _Format(status="applied")
    if kind == "json_object" and not isinstance(rf.get("schema"), dict):
        return _Format(factory.json_object_grammar(rule), json_constrained=True)
    if kind in ("json_object", "json_schema"):
        # llama-server's json_object takes a "schema" beside its type, and enforces it
        spec = rf.get("json_schema") if isinstance(rf.get("json_schema"), dict) else {}
        schema = rf["schema"] if kind == "json_object" else spec.get("schema", spec if "type" in spec else None)
        if not isinstance(schema, dict):
            return _Format(factory.json_object_grammar(rule), json_constrained=True, downgraded=True)
        grammar = factory.json_schema_grammar(schema, rule)
        return _Format(grammar, json_constrained=True, downgraded=bool(grammar.downgraded))
    return _Format(status="ignored_unknown_type")


def _tool_grammar(engine, chat, prompt: _Prompt):
    """The grammar PANTHEON_TOOL_GRAMMAR arms for this request's tool_choice, or None."""
    from pantheon.text.tools import tool_grammar_policy

    policy = tool_grammar_policy(chat.tool_choice, prompt.tools_on) if prompt.tools_on else None
    if policy is None:
        return None
    mode, function = policy
    return engine.grammar_factory.tool_grammar(prompt.dialect, prompt.specs, mode, function=function,
                                               think=prompt.think_rule)


def _gbnf(engine, chat, prompt: _Prompt, fmt: "_Format") -> "_Format":
    """llama-server's `grammar`: the output constrained to a GBNF grammar (after any think block),
    compiled by llguidance; alone, as llama-server takes it (not with tools or a JSON format)."""
    if prompt.tools_on:
        raise PlanError("'grammar' cannot be combined with tools")
    if fmt.grammar is not None:
        raise PlanError("'grammar' cannot be combined with a JSON response_format or json_schema")
    try:
        return _Format(engine.grammar_factory.gbnf_grammar(chat.grammar, prompt.think_rule), status=fmt.status)
    except ValueError as e:
        raise PlanError(f"invalid 'grammar': {e}") from None


def plan_chat(engine, chat, window: int | None = None) -> ChatPlan:
    """Render, tokenize and constrain `chat` for `engine`. With window, a prompt that cannot fit
    (len >= window) raises PromptOverBudget as soon as that is known, before any grammar compile. A
    raw prompt (`chat.prompt`, the completions API) skips the template and tools."""
    prompt = _prompt(engine, chat, window)
    tools = _tool_grammar(engine, chat, prompt)
    fmt = _response_format(engine, chat.response_format, prompt)
    if getattr(chat, "grammar", None):
        fmt = _gbnf(engine, chat, prompt, fmt)
    request = GenerationRequest(
        prompt_ids=prompt.ids, choices=[_sampling(chat, i) for i in range(chat.n)],
        max_tokens=chat.max_tokens, stops=chat.stop, think=prompt.think, start_in_reasoning=prompt.start_in_reasoning,
        session_id=chat.session_id, dialect=prompt.dialect, tools=prompt.specs, grammar=fmt.grammar or tools,
        reasoning_budget=engine.reasoning_budget if chat.reasoning_budget is None else max(chat.reasoning_budget, 0),
        progress=chat.stream and chat.return_progress, timed=chat.stream and chat.timings_per_token,
        prompt_logprobs=getattr(chat, "prompt_logprobs", None), mark_at=_last_turn_start(engine, chat, prompt),
        thoughts_in_content=_thoughts_in_content(chat, prompt))
    return ChatPlan(request, fmt.status, fmt.json_constrained, fmt.downgraded)


def _thoughts_in_content(chat, prompt: _Prompt) -> str | None:
    """reasoning_format "none": None where thoughts are split out (the default), else the text the
    content opens with: the think block's opening where the prompt ends inside one (llama-server
    gives it back in the content too)."""
    if getattr(chat, "reasoning_format", None) != "none" or not prompt.think:
        return None
    return prompt.text[prompt.text.rfind("<think>"):] if prompt.start_in_reasoning else ""


def _last_turn_start(engine, chat, prompt: _Prompt) -> int | None:
    """Where the chat's last user turn starts in its prompt's tokens, for a model whose slots are
    marked (SlotTable.mark: two conversations that share a long system prompt then resume on a
    sliding or recurrent model); None where the model needs no marks, the part before is short, or
    no token boundary is found there. The turn starts where the conversation before it, rendered
    alone, ends; where the template renders no such prefix (Gemma's puts the system prompt inside
    the first user turn), where the turn's own text starts."""
    from pantheon.engine import sessions

    if not getattr(engine, "marks", False) or not prompt.text or len(prompt.ids) <= sessions.MARK_MIN_TOKENS:
        return None
    last = max((i for i, m in enumerate(chat.messages) if m.get("role") == "user"), default=0)
    if last == 0:
        return None
    return _token_boundary(engine.tokenizer, prompt, _turn_heads(engine, chat, prompt, last))


def _turn_heads(engine, chat, prompt: _Prompt, last: int):
    """The prompt text before the last user turn, as candidates in order: the conversation before
    it rendered alone (when that is a prefix of the prompt), then the text before the turn's own."""
    try:
        head = render_prompt(engine, replace(chat, messages=chat.messages[:last]), add_generation_prompt=False)[0]
    except PlanError:
        head = None
    if head and prompt.text.startswith(head):
        yield head
    content = chat.messages[last].get("content")
    at = prompt.text.rfind(content) if isinstance(content, str) and content else -1
    if at > 0:
        yield prompt.text[:at]


def _token_boundary(tok, prompt: _Prompt, heads) -> int | None:
    """How many of the prompt's tokens spell the first of `heads` (prefixes of its text) that a token
    ends on (at least MARK_MIN_TOKENS, not all of them); None where none does. Found from the tokens'
    byte lengths, summed once (no second tokenizing of ~20k tokens: 220 ms measured), checked by
    decoding the tokens back to the head."""
    from pantheon.engine import sessions

    ids, ends = prompt.ids, None
    for head in heads:
        if ends is None:
            ends = np.cumsum([len(tok.token_bytes(t)) for t in ids])
            lead = int(ends[-1]) - len(prompt.text.encode("utf-8"))  # a space the tokenizer put before the text
        end = len(head.encode("utf-8")) + lead
        k = int(np.searchsorted(ends, end)) + 1
        if sessions.MARK_MIN_TOKENS <= k < len(ids) and ends[k - 1] == end and tok.decode(ids[:k]) == head:
            return k
    return None
