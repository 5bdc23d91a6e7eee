"""Chat templates rendered with jinja2 in the sandboxed environment transformers uses."""

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Roles every chat template is written for; any other must appear in the template itself.
STANDARD_ROLES = ("system", "user", "assistant", "tool")
# Names a message's reasoning may come under; templates read one or another (transformers fills them all).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(template: str, messages, add_generation_prompt: bool, variables: dict) -> str:
    """Render `messages` with a chat template, raising ValueError for malformed messages or templates.

    Args:
      template: the Jinja2 source of the chat template.
      messages: the conversation, a list of {"role": str, "content": str, ...} dicts.
      add_generation_prompt: end with the header that starts the assistant's reply.
      variables: further template variables (special tokens, tools, documents, ...).
    """
    _check_messages(messages)
    _check_roles(template, messages)
    compiled = _compile_chat_template(template)
    try:
        return compiled.render(
            messages=[_template_message(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as error:
        raise ValueError(f"The chat template rejected the conversation: {error}") from error


def _check_messages(messages) -> None:
    """Raise ValueError unless `messages` is a non-empty list of dicts with string 'role' and 'content'."""
    problem = None
    if not isinstance(messages, (list, tuple)) or not messages:
        problem = f"messages must be a non-empty list of {{'role': str, 'content': str}} dicts, got {messages!r}"
    else:
        problem = next(filter(None, (_message_problem(index, message) for index, message in enumerate(messages))), None)
    if problem is not None:
        raise ValueError(problem)


def _check_roles(template: str, messages) -> None:
    """Raise ValueError for a role outside STANDARD_ROLES that the template never names (it would be ignored or
    rendered as if it meant something)."""
    for index, message in enumerate(messages):
        role = message["role"]
        if role not in STANDARD_ROLES and f"'{role}'" not in template and f'"{role}"' not in template:
            raise ValueError(
                f"messages[{index}] has role {role!r}, which this model's chat template does not name; use one of "
                f"{', '.join(STANDARD_ROLES)}"
            )


def _message_problem(index: int, message) -> str | None:
    """Describe what is wrong with one chat message, or return None when it is well formed."""
    if not isinstance(message, Mapping):
        return f"messages[{index}] must be a dict with 'role' and 'content' strings, got {message!r}"
    for key in ("role", "content"):
        if not isinstance(message.get(key), str):
            return f"messages[{index}] needs a string {key!r}, got {message!r}"
    return None


def _template_message(message: Mapping) -> dict:
    """Copy a message as transformers hands it to templates: None values dropped, reasoning under every name."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class _GenerationBlock(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` blocks, rendering their body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        """Parse the block up to `{% endgeneration %}`."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        """Return the block's rendered body."""
        return caller()


def _raise_exception(message):
    """Template helper: stop rendering with `message`."""
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Template filter: JSON without Jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    """Template helper: the current local time, formatted."""
    return datetime.now().strftime(format_string)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers renders them in."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"The chat template is not valid Jinja2: {error}") from error
