"""The plugin system: inline plugins, entry points, broken plugins isolated, PARITY_PLUGINS."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pluggy
import pytest

from parity.backends.cpu.backend import CpuBackend
from parity.core.hookspecs import hookimpl
from parity.core.plugins import (
    PluginWarning,
    collect_backends,
    forget_backends,
    load_backends,
    plugin_filter,
    plugin_manager,
)
from parity.errors import PluginError


class InlineBackend(CpuBackend):
    name = "inline"


class InlinePlugin:
    @hookimpl
    def parity_register_backends(self, register):
        register(InlineBackend)


@pytest.fixture
def pm():
    manager, broken = plugin_manager(env={"PARITY_PLUGINS": "cpu"})
    assert broken == {}
    return manager


@pytest.fixture
def inline_plugin(pm):
    pm.register(InlinePlugin(), name="inline-plugin")
    try:
        yield pm
    finally:
        pm.unregister(name="inline-plugin")


def test_builtin_cpu_registers_through_the_hook(pm):
    registry = collect_backends(pm)
    assert registry.backends == {"cpu": CpuBackend} and registry.owners["cpu"] == "cpu"


def test_builtin_cuda_registers_without_importing_torch():
    from parity.backends.cuda.backend import CudaBackend

    registry = collect_backends(*plugin_manager(env={"PARITY_PLUGINS": "cuda"}))
    assert registry.backends == {"cpu": CpuBackend, "cuda": CudaBackend}
    assert registry.owners["cuda"] == "cuda"
    probe = (
        "import sys, parity.core.plugins as p; r = p.load_backends(); r.get('cuda').available(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cuda')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # discovery imports neither torch nor the CUDA bindings


def test_inline_plugin_registers_and_unregisters(inline_plugin):
    registry = collect_backends(inline_plugin)
    assert registry.backends["inline"] is InlineBackend
    assert registry.owners["inline"] == "inline-plugin"


def test_bad_hook_signature_is_refused(pm):
    class BadPlugin:
        @hookimpl
        def parity_register_backends(self, register, device):  # 'device' is no hook argument
            pass

    with pytest.raises(pluggy.PluginValidationError):
        pm.register(BadPlugin(), name="bad")


@pytest.mark.parametrize(
    "offered, message",
    [
        (object, "not a subclass"),
        (type("Nameless", (CpuBackend,), {"name": ""}), "has no backend name"),
        (type("Old", (CpuBackend,), {"name": "old", "api_version": 0}), "plugin API version 0"),
        (type("Twin", (CpuBackend,), {"name": "cpu"}), "already registered by plugin 'cpu'"),
        ((InlineBackend, InlineBackend), "registers two backends named 'inline'"),
        (
            type("Tiers", (CpuBackend,), {"name": "tiers", "manifest": {"ADD": "close"}}),
            "backend 'tiers' declares a bad manifest: bad tier 'close'",
        ),
    ],
)
def test_bad_registrations_mark_only_that_plugin_broken(pm, offered, message):
    class Plugin:
        @hookimpl
        def parity_register_backends(self, register):
            for cls in offered if isinstance(offered, tuple) else (offered,):
                register(cls)

    pm.register(Plugin(), name="faulty")
    try:
        with pytest.warns(PluginWarning, match="'faulty' is broken"):
            registry = collect_backends(pm)
    finally:
        pm.unregister(name="faulty")
    assert message in registry.broken["faulty"]
    assert "cpu" in registry.backends


def test_plugin_that_raises_while_registering(pm):
    class Plugin:
        @hookimpl
        def parity_register_backends(self, register):
            raise RuntimeError("no driver")

    pm.register(Plugin(), name="raises")
    try:
        with pytest.warns(PluginWarning, match="PARITY_PLUGINS=-raises"):
            registry = collect_backends(pm)
    finally:
        pm.unregister(name="raises")
    assert registry.broken == {"raises": "failed to register: RuntimeError: no driver"}
    assert set(registry.backends) == {"cpu"}


@pytest.fixture
def entry_points_on_path(tmp_path, monkeypatch):
    """Install fake distributions with ``parity`` entry points into a temporary sys.path dir."""
    modules = {
        "ptest_good": """
            from parity.backends.cpu.backend import CpuBackend
            from parity.core.hookspecs import hookimpl

            class GoodBackend(CpuBackend):
                name = "good"

            @hookimpl
            def parity_register_backends(register):
                register(GoodBackend)
        """,
        "ptest_import_error": "raise ImportError('needs libfoo.so')\n",
        "ptest_old_api": """
            from parity.backends.cpu.backend import CpuBackend
            from parity.core.hookspecs import hookimpl

            class OldBackend(CpuBackend):
                name = "oldapi"
                api_version = 0

            @hookimpl
            def parity_register_backends(register):
                register(OldBackend)
        """,
        "ptest_typo": """
            from parity.core.hookspecs import hookimpl

            @hookimpl
            def parity_register_backend(register):  # the hook is parity_register_backends
                pass
        """,
        "ptest_bad_hook": """
            from parity.core.hookspecs import hookimpl

            @hookimpl
            def parity_register_backends(register, extra):
                pass
        """,
    }
    for name, body in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    dist = tmp_path / "ptest_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ptest-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[parity]\ngood = ptest_good\nmissing = ptest_not_there\n"
        "importerror = ptest_import_error\nbadhook = ptest_bad_hook\ntypo = ptest_typo\n"
        "oldapi = ptest_old_api\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_backends()  # plugins load once per process: this one has new ones
    yield
    forget_backends()


def test_broken_entry_points_are_isolated(entry_points_on_path):
    with pytest.warns(PluginWarning) as caught:
        registry = load_backends(env={})
    assert {"cpu", "good"} <= set(registry.backends)  # and any plugin installed here
    assert set(registry.broken) == {"missing", "importerror", "badhook", "typo", "oldapi"}
    assert "ModuleNotFoundError" in registry.broken["missing"]
    assert "needs libfoo.so" in registry.broken["importerror"]
    assert registry.broken["badhook"].startswith("rejected: PluginValidationError")
    assert "parity_register_backend" in registry.broken["typo"]
    assert "targets plugin API version 0, this parity speaks 2" in registry.broken["oldapi"]
    assert len(caught) == 5 and all("is broken and was skipped" in str(w.message) for w in caught)
    # the working plugin's backend runs
    assert registry.get("good").available().ok


def test_parity_plugins_limits_what_loads(entry_points_on_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no broken plugin may even be imported
        only = load_backends(env={"PARITY_PLUGINS": "good"})
        assert set(only.backends) == {"cpu", "good"} and not only.broken  # cpu always loads
        rest = load_backends(env={"PARITY_PLUGINS": "-missing,-importerror,-badhook,-typo,-oldapi"})
        assert {"cpu", "good"} <= set(rest.backends) and not rest.broken
        assert set(load_backends(env={"PARITY_PLUGINS": "good,-cpu"}).backends) == {"cpu", "good"}
        assert set(load_backends(env={"PARITY_PLUGINS": "good,cuda"}).backends) == {
            "cpu", "good", "cuda",
        }  # fmt: skip


def test_plugin_filter_parsing():
    assert plugin_filter(None) == (None, set())
    assert plugin_filter("cpu, jax") == ({"cpu", "jax"}, set())
    assert plugin_filter("-jax,-cuda") == (None, {"jax", "cuda"})


def test_unknown_backend_names_the_installed_ones(pm):
    registry = collect_backends(pm)
    registry.broken["jax"] = "failed to import"
    with pytest.raises(PluginError, match=r"unknown backend 'rocm'; installed backends: cpu.*jax"):
        registry.get("rocm")


def test_broken_plugins_on_the_command_line(entry_points_on_path, capsys):
    """`parity backends` lists each broken plugin with its reason; other commands warn in one
    line per plugin and keep working; asking for a broken plugin's backend says why."""
    from parity.cli.main import main

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        assert main(["backends"]) == 0
        out = capsys.readouterr().out
        assert "good       available" in out
        assert "importerror broken: failed to import ptest_import_error: ImportError" in out
        assert (
            "oldapi     broken: failed to register: PluginError: backend 'oldapi' targets "
            "plugin API version 0" in out
        )
        forget_backends()  # each command is a process of its own, which loads plugins once
        assert main(["conformance", "good", "-k", "argmax"]) == 0
        err = capsys.readouterr().err
        assert err.count("parity: warning: parity plugin 'importerror' is broken") == 1
        assert "Traceback" not in err and "PluginWarning" not in err
        assert main(["conformance", "oldapi"]) == 1
        err = capsys.readouterr().err
        assert (
            "parity: error: backend 'oldapi' is not available: its plugin 'oldapi' is broken" in err
        )


def test_a_misspelled_plugin_name_is_a_warning_that_lists_the_installed_ones():
    with pytest.warns(PluginWarning, match=r"names 'jaxx', which no installed plugin is; "
                      r"installed: .*cpu.*cuda"):  # fmt: skip
        plugin_manager(env={"PARITY_PLUGINS": "jaxx"})
    with pytest.warns(PluginWarning, match="'nope'"):
        plugin_manager(env={"PARITY_PLUGINS": "-nope"})
