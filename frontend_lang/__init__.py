"""frontend_lang: agent programs over a radixserve server, shaped like SGLang's frontend
language (`import frontend_lang as sgl`).

    @sgl.function
    def qa(s, question):
        s += sgl.system("You are terse.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=32))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="Capital of France?", temperature=0)["answer"])
"""

from frontend_lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    public_prefix_end,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from frontend_lang.backend import FrontendError, RuntimeEndpoint
from frontend_lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from frontend_lang.global_config import global_config
from frontend_lang.openai_backend import OpenAI
from frontend_lang.runtime import ProgramState, SglFunction, flush_cache, function, get_server_info, set_default_backend
from frontend_lang.server import Runtime

__all__ = [
    "ChoicesDecision", "ChoicesSamplingMethod", "FrontendError", "OpenAI", "ProgramState", "Runtime", "RuntimeEndpoint",
    "SglFunction", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int",
    "gen_string", "get_server_info", "global_config", "greedy_token_selection", "image", "public_prefix_end", "select",
    "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]
