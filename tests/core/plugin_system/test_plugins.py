"""The plugin manager: built-ins and a real installed third-party distribution load the same way."""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.plugin_install import pip_install

from pitstop import EngineConfig
from pitstop.entrypoints.cli import main as cli_main
from pitstop.entrypoints.commands import commands
from pitstop.errors import ModelLoadError, PluginError
from pitstop.plugin_system import hookspecs
from pitstop.plugin_system.plugin_manager import KINDS, PluginManager

ROOT = Path(__file__).resolve().parents[3]


def test_builtins_register_through_entry_points() -> None:
    pm = PluginManager(allow=None)
    for kind, name in [
        ("allocator", "paged"),
        ("scheduler", "continuous"),
        ("kernels", "reference"),
        ("sampler", "standard"),
        ("model", "LlamaForCausalLM"),
        ("model", "Qwen2ForCausalLM"),
        ("model", "Qwen3ForCausalLM"),
    ]:
        strategy = pm.get(kind, name)
        assert strategy.distribution == "pitstop"
        assert strategy.version
    # every entry point of the project names a module that registers something
    assert all(
        source.distribution == "pitstop"
        for source in pm.sources
        if source.module.__name__.startswith("pitstop.")
    )


def test_core_imports_no_plugin_by_name() -> None:
    import ast

    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                assert not name.startswith("pitstop.plugins."), (
                    f"{path}:{node.lineno} imports the built-in plugin {name}; go through the plugin manager"
                )


def test_discovers_an_installed_third_party_distribution(with_example: Path) -> None:
    pm = PluginManager(allow=None)
    lifo = pm.get("allocator", "lifo")
    assert lifo.distribution == "pitstop-example"
    assert lifo.version == "0.3.0"
    assert lifo.module == "pitstop_example"
    allocator = pm.create("allocator", "lifo", EngineConfig(page_size=4), 8)
    assert allocator.stats().pages_free == 8
    assert pm.has_observers("on_request_finished")


def test_plugins_command_lists_kind_name_distribution_version(
    with_example: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pitstop.plugin_system.plugin_manager as pmod

    monkeypatch.setattr(pmod, "_default", None)
    assert cli_main(["plugins"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert ["allocator", "lifo", "pitstop-example", "0.3.0"] in [r[:4] for r in rows]
    assert ["allocator", "paged", "pitstop"] in [r[:3] for r in rows]
    monkeypatch.setattr(pmod, "_default", None)


def test_allow_list_narrows_what_loads(with_example: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PITSTOP_PLUGINS", "pitstop-example")
    pm = PluginManager()
    assert pm.names("allocator") == ["lifo"]
    monkeypatch.setenv("PITSTOP_PLUGINS", "pitstop")  # by distribution name
    pm = PluginManager()
    assert "lifo" not in pm.names("allocator") and "paged" in pm.names("allocator")
    monkeypatch.setenv(
        "PITSTOP_PLUGINS", "allocators-paged,kernels-reference"
    )  # by entry-point name
    pm = PluginManager()
    assert pm.names("allocator") == ["paged"] and pm.names("kernels") == ["reference"]
    with pytest.raises(PluginError, match="PITSTOP_PLUGINS is set"):
        pm.get("scheduler", "continuous")


def test_two_distributions_claiming_one_name_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    (src / "dup_alloc").mkdir(parents=True)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "pitstop-dup"
            version = "9.9"
            [project.entry-points.pitstop]
            dup = "dup_alloc"
            [tool.setuptools]
            packages = ["dup_alloc"]
            """
        )
    )
    (src / "dup_alloc" / "__init__.py").write_text(
        "import pitstop\n\n@pitstop.hookimpl\ndef register_allocators(register):\n"
        "    register('paged', lambda config, num_pages: None)\n"
    )
    site = tmp_path / "site"
    pip_install(src, site)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    try:
        with pytest.raises(PluginError) as err:
            PluginManager(allow=None)
        message = str(err.value)
        assert "'paged'" in message and "pitstop-dup" in message and "pitstop " in message
    finally:
        sys.modules.pop("dup_alloc", None)


def test_unknown_name_lists_the_names_that_exist() -> None:
    pm = PluginManager(allow=None)
    with pytest.raises(PluginError) as err:
        pm.get("allocator", "nope")
    assert "nope" in str(err.value) and "paged" in str(err.value)


def test_unknown_strategy_in_config_fails_before_weights_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pitstop.loop.engine as engine_mod

    def boom(*args, **kwargs):
        raise AssertionError("weights must not load for a config with an unknown strategy")

    monkeypatch.setattr(engine_mod, "load_model_source", boom)
    from pitstop.loop.engine import LLMEngine

    with pytest.raises(PluginError, match="registered scheduler names"):
        LLMEngine(EngineConfig(scheduler="does-not-exist"))


def test_a_plugin_that_fails_to_import_names_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pitstop]\nbroken = no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(PluginError, match="broken"):
        PluginManager(allow=None)


def _hook_names() -> list[str]:
    return [
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, "pitstop_spec")
    ]


def test_every_hook_has_a_docstring() -> None:
    names = _hook_names()
    assert set(KINDS.values()) <= set(names)
    assert {"on_step_finished", "on_request_finished"} <= set(names)
    for name in names:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert len(doc.strip()) > 40, f"hook {name} needs a docstring saying when it is called"


def test_every_hook_is_documented_in_docs() -> None:
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    missing = [name for name in _hook_names() if f"`{name}" not in docs]
    assert not missing, f"hooks missing from docs/: {missing}"


def test_plugins_md_names_every_protocol_member_of_every_kind() -> None:
    """docs/plugins.md is enough to write any kind: it names each kind's factory, register hook
    and every member of its protocol (so a member added to pitstop.plugin_system.protocols must be documented)."""
    from pitstop.plugin_system.kinds import KINDS as KIND_TABLE
    from pitstop.plugin_system.kinds import protocol_members

    text = (ROOT / "docs" / "plugins.md").read_text()
    missing = []
    for kind in KIND_TABLE.values():
        factory = kind.factory.split("(")[0]
        assert f"`{kind.hook}(" in text and f"`{factory}(" in text, kind.name
        missing += [
            f"{kind.protocol.__name__}.{name}"
            for name in protocol_members(kind.protocol)
            if f"`{name}`" not in text and f"`{name}(" not in text
        ]
    assert not missing, f"protocol members missing from docs/plugins.md: {missing}"
    for section in ("An allocator", "A scheduler", "A kernel set", "A proposer", "A sampler"):
        assert f"### {section}" in text
    assert "### A model architecture" in text and "### A subcommand" in text


def test_example_plugin_runs_the_engine_and_observes_requests(
    with_example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers.models import make_tiny_checkpoint

    from pitstop import LLM, SamplingParams

    folder = make_tiny_checkpoint(tmp_path, "llama")
    prompts = [[5, 6, 7, 8], [9] * 20, [3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pm = PluginManager(allow=None)
    lifo = LLM(str(folder), device="cpu", allocator="lifo", max_num_pages=32, plugins=pm)
    paged = LLM(str(folder), device="cpu", allocator="paged", max_num_pages=32, plugins=pm)
    import pitstop_example

    before = pitstop_example.FINISHED["length"]
    got = [o.token_ids for o in lifo.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == [
        o.token_ids for o in paged.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert pitstop_example.FINISHED["length"] - before == 2 * len(prompts)
    assert lifo.engine.allocator.stats().pages_free == 32


def test_the_example_plugin_adds_a_subcommand(
    with_example: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pitstop.plugin_system.plugin_manager as pmod

    monkeypatch.setattr(pmod, "_default", None)
    registered = commands(pmod.get_plugin_manager())
    assert registered["lifo-demo"].distribution == "pitstop-example"
    assert {"serve", "bench", "verify"} <= set(registered)  # registered the same way
    assert cli_main(["lifo-demo", "--page-size", "4", "--tokens", "5", "9", "3"]) == 0
    out = capsys.readouterr().out
    assert "s0: pages [0, 1]" in out and "s1: pages [2, 3, 4]" in out
    assert "again: pages [0, 1]" in out  # s0's pages, freed last, come back first
    # the command reads the plugin's own setting through the same flags
    assert cli_main(["lifo-demo", "--page-size", "4", "--lifo.max-pages", "3"]) == 1
    assert "do not fit" in capsys.readouterr().out
    assert cli_main(["plugins"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["command", "lifo-demo", "pitstop-example", "0.3.0"] in [r[:4] for r in rows]
    monkeypatch.setattr(pmod, "_default", None)


def test_a_command_name_pitstop_has_is_refused() -> None:
    from types import ModuleType

    import pitstop

    module = ModuleType("clash")

    @pitstop.hookimpl
    def register_commands(register) -> None:
        register("serve", lambda p: None, lambda a: 0)

    module.register_commands = register_commands  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match="two plugins register the command 'serve'"):
        commands(PluginManager(extra_modules=[module]))


def test_a_third_party_architecture_loads_and_runs(
    with_example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's BigramForCausalLM, found through its entry point: the HF loader asks
    the registry for its config parsing and tensor names, and the engine runs it."""
    import json

    import torch
    from safetensors.torch import save_file

    from pitstop import LLM, SamplingParams

    vocab, hidden = 50, 8
    gen = torch.Generator().manual_seed(3)
    embed = torch.randn(vocab, hidden, generator=gen)
    head = torch.randn(vocab, hidden, generator=gen)
    folder = tmp_path / "bigram"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bigram",
                "architectures": ["BigramForCausalLM"],
                "vocab_size": vocab,
                "hidden_size": hidden,
            }
        )
    )
    save_file(
        {"model.embed_tokens.weight": embed, "lm_head.weight": head}, folder / "m.safetensors"
    )
    pm = PluginManager(allow=None)
    assert pm.get("model", "BigramForCausalLM").distribution == "pitstop-example"
    llm = LLM(str(folder), plugins=pm, device="cpu", max_model_len=64, kv_cache_gib=0.01)
    prompt = [7, 3]
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    expected, token = [], prompt[-1]
    for _ in range(6):  # greedy: the argmax of the last token's logits, every step
        token = int((head @ embed[token]).argmax())
        expected.append(token)
    assert out.token_ids == expected
    # the loader checks its tensors by the plugin's names and shapes
    save_file({"model.embed_tokens.weight": embed}, folder / "m.safetensors")
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        LLM(str(folder), plugins=pm, device="cpu", max_model_len=64, kv_cache_gib=0.01)


def test_an_architecture_nobody_registers_is_refused_naming_the_plugins(tmp_path: Path) -> None:
    import json

    from pitstop.plugins.model_sources.huggingface.checkpoint import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(
        ModelLoadError,
        match="model_type='mamba'.*llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe",
    ):
        read_hf_config(tmp_path, PluginManager())


# ---------------------------------------------------------------------- GGUF of a plugin
def _write_gguf(path: Path, architecture: str, tensors: dict, fields: dict) -> Path:
    """A float32 GGUF file of ``architecture`` with a tokenizer of token_embd's rows."""
    from helpers.checkpoints import write_gguf

    return write_gguf(path, architecture, fields, tensors, tensors["token_embd.weight"].shape[0])


def test_a_third_party_architecture_loads_from_gguf_and_runs(
    with_example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's BigramForCausalLM claims general.architecture 'bigram': the GGUF
    loader asks the registry, the plugin reads the metadata, the loader renames and checks
    the tensors by the plugin's rules, and the engine runs it, converted and then cached."""
    import numpy as np

    from pitstop import LLM, SamplingParams
    from pitstop.loading.weights import load_model_source

    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path / "cache"))
    vocab, hidden = 40, 8
    rng = np.random.default_rng(5)
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
    head = rng.standard_normal((vocab, hidden)).astype(np.float32)
    path = _write_gguf(
        tmp_path / "bigram.gguf",
        "bigram",
        {"token_embd.weight": embed, "output.weight": head},
        {"bigram.embedding_length": hidden, "bigram.context_length": 64},
    )
    pm = PluginManager(allow=None)
    expected, token = [], 7
    for _ in range(6):  # greedy: the argmax of the last token's logits, every step
        token = int((head @ embed[token]).argmax())
        expected.append(token)
    for run in range(2):  # converted, then read back from the cache
        if run == 1:
            assert "cached at" in load_model_source(str(path), plugins=pm).description
        llm = LLM(str(path), plugins=pm, device="cpu", max_model_len=64, kv_cache_gib=0.01)
        mc = llm.engine.model_config
        assert (mc.architecture, mc.vocab_size, mc.hidden_size) == (
            "BigramForCausalLM",
            vocab,
            hidden,
        )
        assert mc.max_position_embeddings == 64 and mc.eos_token_ids == (2,)
        out = llm.generate(
            prompt_token_ids=[[3, 7]],
            sampling_params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert out.token_ids == expected
    assert llm.engine.tokenizer.encode("t1", add_special_tokens=False) == [2]  # the file's own

    # the loader checks the tensors by the plugin's names and shapes
    bad = _write_gguf(
        tmp_path / "extra.gguf",
        "bigram",
        {"token_embd.weight": embed, "output.weight": head, "blk.0.attn_q.weight": head},
        {"bigram.embedding_length": hidden},
    )
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight.*refuses rather than skips"):
        LLM(str(bad), plugins=pm, device="cpu", max_model_len=64, kv_cache_gib=0.01)
    # and the plugin refuses a field of its architecture it does not read
    odd = _write_gguf(
        tmp_path / "odd.gguf",
        "bigram",
        {"token_embd.weight": embed, "output.weight": head},
        {"bigram.embedding_length": hidden, "bigram.block_count": 2},
    )
    with pytest.raises(ModelLoadError, match="bigram.block_count is not a bigram field"):
        LLM(str(odd), plugins=pm, device="cpu", max_model_len=64, kv_cache_gib=0.01)


def test_a_fix_tensor_that_changes_a_shape_is_refused(
    with_example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import ModuleType

    import attrs
    import numpy as np
    from pitstop_example import bigram

    import pitstop
    from pitstop.loading.weights import load_model_source

    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path / "cache"))
    module = ModuleType("transposing")

    @pitstop.hookimpl
    def register_models(register) -> None:
        gguf = attrs.evolve(bigram.BIGRAM.gguf, fix_tensor=lambda name, t, config: t.T)
        rules = attrs.evolve(bigram.BIGRAM, gguf=gguf)
        register(bigram.ARCHITECTURE, bigram.make_bigram, architecture=rules)

    module.register_models = register_models  # type: ignore[attr-defined]
    pm = PluginManager(allow=["pitstop"], extra_modules=[module])
    embed = np.zeros((16, 4), dtype=np.float32)
    path = _write_gguf(
        tmp_path / "t.gguf",
        "bigram",
        {"token_embd.weight": embed, "output.weight": embed},
        {"bigram.embedding_length": 4},
    )
    with pytest.raises(
        ModelLoadError, match=r"fix_tensor turned token_embd.weight of shape \[16, 4\]"
    ):
        load_model_source(str(path), plugins=pm).weights()  # the first dense read converts


def test_a_gguf_architecture_nobody_claims_is_refused_naming_the_claimed_ones(
    with_example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    from pitstop.loading.weights import load_model_source

    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path / "cache"))
    embed = np.zeros((16, 4), dtype=np.float32)
    path = _write_gguf(
        tmp_path / "mamba.gguf", "mamba", {"token_embd.weight": embed}, {"mamba.block_count": 1}
    )
    with pytest.raises(ModelLoadError) as info:
        load_model_source(str(path), plugins=PluginManager(allow=None))
    msg = str(info.value)
    assert "architecture 'mamba' (general.architecture), which no registered model plugin" in msg
    claims = "bigram, llama, qwen2, qwen3 (BigramForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM"
    assert f"the registered ones read {claims}, Qwen3ForCausalLM)" in msg
    with pytest.raises(ModelLoadError, match="architecture 'mamba'.*read llama, qwen2, qwen3 \\("):
        load_model_source(str(path), plugins=PluginManager(allow=["pitstop"]))  # built-ins
    assert not list((tmp_path / "cache").glob("gguf/*-v*"))  # nothing converted, nothing cached


# ---------------------------------------------------------------------- model sources
def test_a_third_party_model_source_loads_its_files(with_example: Path, tmp_path: Path) -> None:
    """The example's ``npz`` source claims *.npz files and loads them as its bigram model;
    without it such a file is refused, naming what the registered sources read."""
    import numpy as np

    from pitstop import LLM, SamplingParams
    from pitstop.loading.weights import load_model_source

    vocab, hidden = 40, 8
    rng = np.random.default_rng(3)
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
    head = rng.standard_normal((vocab, hidden)).astype(np.float32)
    path = tmp_path / "bigram.npz"
    np.savez(path, embed=embed, head=head)
    pm = PluginManager(allow=None)
    assert pm.names("source") == ["gguf", "huggingface", "npz"]
    llm = LLM(str(path), plugins=pm, device="cpu", max_model_len=64, kv_cache_gib=0.01)
    assert llm.engine.model_config.architecture == "BigramForCausalLM"
    expected, token = [], 7
    for _ in range(5):
        token = int((head @ embed[token]).argmax())
        expected.append(token)
    out = llm.generate(
        prompt_token_ids=[[3, 7]],
        sampling_params=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.token_ids == expected

    np.savez(tmp_path / "half.npz", embed=embed)
    with pytest.raises(ModelLoadError, match="must hold arrays embed and head"):
        load_model_source(str(tmp_path / "half.npz"), plugins=pm)
    with pytest.raises(ModelLoadError) as info:
        load_model_source(str(path), plugins=PluginManager(allow=["pitstop"]))
    msg = str(info.value)
    assert "is a file no registered model source reads; pass 'smollm2-135m', a .gguf file" in msg
    assert msg.endswith("(PITSTOP_PLUGINS is set)")


def test_model_sources_are_asked_in_name_order_and_take_no_settings() -> None:
    from types import ModuleType

    import pitstop
    from pitstop.loading.weights import load_model_source
    from pitstop.plugin_system.protocols import ModelSourceReaderBase

    class Claims(ModelSourceReaderBase):
        accepts = "'x'"

        def __init__(self, name: str) -> None:
            self.name = name

        def claims(self, model: str) -> bool:
            return model == "x"

        def load(self, model: str, tokenizer: object) -> None:
            raise ModelLoadError(f"{self.name} loads {model}")

    def module(settings: object = None) -> ModuleType:
        made = ModuleType("two_sources")

        @pitstop.hookimpl
        def register_model_sources(register) -> None:
            register("b-source", lambda plugins: Claims("b"), settings=settings)
            register("a-source", lambda plugins: Claims("a"))

        made.register_model_sources = register_model_sources  # type: ignore[attr-defined]
        return made

    pm = PluginManager(allow=["pitstop"], extra_modules=[module()])
    with pytest.raises(ModelLoadError, match="a loads x"):
        load_model_source("x", plugins=pm)
    assert load_model_source("dummy:qwen3-0.6b", plugins=pm).is_dummy  # claimed by none
    with pytest.raises(PluginError, match="model source 'b-source' takes no settings"):
        PluginManager(allow=["pitstop"], extra_modules=[module(settings=object)])


def test_a_source_asked_last_lets_every_other_source_claim_first(tmp_path: Path) -> None:
    """``huggingface`` claims any folder, so it is asked after the others (``asked_last``):
    a source of a folder format of its own gets its folders whatever its name."""
    from types import ModuleType

    import pitstop
    from pitstop.loading.weights import load_model_source, model_sources
    from pitstop.plugin_system.protocols import ModelSourceReaderBase

    class Folders(ModelSourceReaderBase):
        accepts = "a folder with model.zzz"

        def claims(self, model: str) -> bool:
            return (Path(model) / "model.zzz").is_file()

        def load(self, model: str, tokenizer: object) -> None:
            raise ModelLoadError(f"zzz loads {model}")

    module = ModuleType("folder_source")

    @pitstop.hookimpl
    def register_model_sources(register) -> None:
        register("zzz", lambda plugins: Folders())

    module.register_model_sources = register_model_sources  # type: ignore[attr-defined]
    pm = PluginManager(allow=["pitstop"], extra_modules=[module])
    names = [type(s).__name__ for s in model_sources(pm)]
    assert names == ["GGUFSource", "Folders", "HuggingFaceSource"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.zzz").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="zzz loads"):
        load_model_source(str(tmp_path / "mine"), plugins=pm)
    (tmp_path / "other").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model_source(str(tmp_path / "other"), plugins=pm)


def test_two_architectures_claiming_one_gguf_architecture_are_refused() -> None:
    from types import ModuleType

    import pitstop
    from pitstop.plugin_system.architecture import Architecture, GGUFRules
    from pitstop.plugins.models import llama

    module = ModuleType("clash")

    @pitstop.hookimpl
    def register_models(register) -> None:
        rules = Architecture(
            config_from_hf=lambda raw, where: None,
            weight_shapes=llama.expected_weight_shapes,
            rotary=llama.rotary_cache,
            gguf=GGUFRules(("llama",), config=lambda f: None, tensor_name=lambda n: None),
        )
        register("MyLlamaForCausalLM", llama.make_llama, architecture=rules)

    module.register_models = register_models  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match="general.architecture 'llama'.*LlamaForCausalLM"):
        PluginManager(extra_modules=[module])
    for claimed in ((), "llama"):  # a bare string would claim its letters
        with pytest.raises(ValueError, match="names at least one general.architecture"):
            GGUFRules(claimed, config=lambda f: None, tensor_name=lambda n: None)
    with pytest.raises(TypeError, match="'config_from_hf' must be callable"):  # no built-in reader
        Architecture(config_from_hf=None, weight_shapes=len, rotary=len)


def test_presets_come_from_the_architectures_that_give_them(with_example: Path) -> None:
    from types import ModuleType

    import attrs

    import pitstop
    from pitstop import LLM, SamplingParams
    from pitstop.plugins.models import llama

    pm = PluginManager(allow=None)
    assert pm.presets()["bigram-tiny"].architecture == "BigramForCausalLM"
    assert pm.presets()["qwen3-8b"].architecture == "Qwen3ForCausalLM"
    llm = LLM("dummy:bigram-tiny", plugins=pm, device="cpu", max_model_len=32, kv_cache_gib=0.01)
    assert llm.engine.model_config is pm.presets()["bigram-tiny"]
    out = llm.generate(
        prompt_token_ids=[[1, 2]],
        sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.token_ids) == 4 and all(0 <= t < 64 for t in out.token_ids)

    module = ModuleType("clash")
    qwen3 = PluginManager().architecture("Qwen3ForCausalLM")

    @pitstop.hookimpl
    def register_models(register) -> None:
        preset = attrs.evolve(qwen3.presets["qwen3-8b"], architecture="MyQwen3ForCausalLM")
        rules = attrs.evolve(qwen3, gguf=None, presets={"qwen3-8b": preset})
        register("MyQwen3ForCausalLM", llama.make_llama, architecture=rules)

    module.register_models = register_models  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match="two model plugins give the preset 'qwen3-8b'"):
        PluginManager(extra_modules=[module])
