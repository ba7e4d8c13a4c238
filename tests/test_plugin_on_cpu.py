"""The plugin's two guarded steps: a fault in the CPU port can never switch token selection off on a host
that does not ask for the CPU platform (a GPU cluster), and it is reported under its own message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")

# every import of the CPU port fails in the child process, as a broken install or a bad edit would make it
BREAK_CPU_PORT = "import sys; sys.modules['verl_tokensel.cpu'] = None\n"


def _run(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**base, **env})


def test_cpu_port_fault_does_not_switch_selection_off_without_the_cpu_platform():
    code = BREAK_CPU_PORT + (
        "import verl\n"
        "import verl_tokensel.plugin as p\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "assert p.LOAD_ERROR is None, p.LOAD_ERROR\n"
        "assert p.CPU_LOAD_ERROR is None, p.CPU_LOAD_ERROR\n"
        "assert get_trainer_cls('tokensel_sync').__name__ == 'TokenselPPOTrainerSync'\n"
        "assert sys.modules['verl_tokensel.cpu'] is None\n"
        "assert not [m for m in sys.modules if m.startswith('verl_tokensel.cpu.')]\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "failed to load" not in res.stderr


def test_cpu_port_fault_is_reported_on_its_own_under_verl_platform_cpu():
    code = BREAK_CPU_PORT + (
        "import verl\n"
        "import verl_tokensel.plugin as p\n"
        "assert p.CPU_LOAD_ERROR is not None\n"
    )
    res = _run(code, VERL_PLATFORM="cpu")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "verl_tokensel: the CPU port (verl_tokensel.cpu) failed to load under VERL_PLATFORM=cpu" in res.stderr


def test_selection_product_imports_no_cpu_port():
    """The selection glue, the loss and the driver entry point load without the CPU port."""
    code = BREAK_CPU_PORT + (
        "import verl\n"
        "import verl_tokensel.verl_glue.install, verl_tokensel.verl_glue.prepass, verl_tokensel.main_ppo\n"
        "assert not [m for m in sys.modules if m.startswith('verl_tokensel.cpu.')]\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]


def test_import_verl_with_the_plugin_stays_light():
    """``import verl`` runs in every process verl starts; with the plugin it must not import vLLM, verl's trainer
    package, the selection glue or (off the CPU platform) the CPU port, nor print an accelerator warning. The
    trainer modes still register as soon as verl's trainer package is imported, wherever that happens."""
    code = (
        "import sys\n"
        "import verl\n"
        "heavy = sorted(m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'verl.trainer.ppo.v1', "
        "'verl.checkpoint_engine', 'verl_tokensel.verl_glue', 'verl_tokensel.cpu')))\n"
        "assert not heavy, heavy\n"
        "import verl_tokensel.plugin as p\n"
        "assert p.LOAD_ERROR is None\n"
        "print('MODULES', len(sys.modules), flush=True)\n"
        "print('TRAINERS NEXT', file=sys.stderr, flush=True)\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "assert get_trainer_cls('tokensel_sync').__name__ == 'TokenselPPOTrainerSync'\n"
        "assert get_trainer_cls('tokensel_separate_async').__name__ == 'TokenselPPOTrainerSeparateAsync'\n"
        "assert p.LOAD_ERROR is None and p.ensure_selection_loaded() is None\n"
        "import verl.trainer.ppo.v1 as v1\n"
        "assert v1.__loader__.__class__.__module__ != 'verl_tokensel.plugin', v1.__loader__\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    before_trainers = res.stderr.split("TRAINERS NEXT")[0]
    assert "No supported accelerator detected" not in before_trainers, before_trainers[-2000:]
    plain = _run("import sys, verl; print('MODULES', len(sys.modules))", VERL_USE_EXTERNAL_PLUGINS="none")
    assert plain.returncode == 0, plain.stderr[-3000:]
    n_plugin = int(res.stdout.split("MODULES")[1].split()[0])
    n_plain = int(plain.stdout.split("MODULES")[1].split()[0])
    assert n_plugin - n_plain <= 20, (n_plugin, n_plain)


def test_trainer_classes_unpickle_in_a_process_that_never_imported_verls_trainers():
    code = (
        "import pickle, sys\n"
        "import verl\n"
        "assert 'verl.trainer.ppo.v1' not in sys.modules\n"
        "cls = pickle.loads(pickle.dumps(pickle.Unpickler.find_class(pickle.Unpickler(__import__('io').BytesIO()), "
        "'verl_tokensel.verl_glue.install', 'TokenselPPOTrainerColocateAsync')))\n"
        "assert cls._tokensel_base_mode == 'colocate_async', cls\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
