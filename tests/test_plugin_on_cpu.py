"""The two ``verl.plugins`` entry points, each under verl's own guard: ``tokensel`` (:mod:`verl_tokensel.plugin`,
the trainer modes) and ``tokensel_cpu`` (:mod:`verl_tokensel_cpu.plugin`, the CPU port, loaded only under
``VERL_PLATFORM=cpu``). A fault in the CPU port can never switch token selection off on a host that does not ask
for the CPU platform (a GPU cluster), and it is reported under its own message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.requires("verl")

# every import of the CPU port fails in the child process, as a broken install or a bad edit would make it
BREAK_CPU_PORT = "import sys; sys.modules['verl_tokensel_cpu'] = None\n"
# the port's platform fails to import (its entry point still loads, and reports it)
BREAK_CPU_PLATFORM = "import sys; sys.modules['verl_tokensel_cpu.platform'] = None\n"
# the CPU port's modules imported in the child process, beyond its entry point (which every `import verl` loads)
PORT_MODULES = ("[m for m, mod in sys.modules.items() if mod is not None and m.startswith('verl_tokensel_cpu.') "
                "and m != 'verl_tokensel_cpu.plugin']")


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
        "assert get_trainer_cls('tokensel_sync').__name__ == 'TokenselPPOTrainerSync'\n"
        "assert sys.modules.get('verl_tokensel_cpu.platform') is None\n"
        f"assert not {PORT_MODULES}\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "failed to load" not in res.stderr


def test_cpu_port_fault_is_reported_on_its_own_under_verl_platform_cpu():
    code = BREAK_CPU_PLATFORM + (
        "import verl\n"
        "import verl_tokensel_cpu.plugin as c\n"
        "assert c.LOAD_ERROR is not None\n"
    )
    res = _run(code, VERL_PLATFORM="cpu")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "verl-tokensel: the CPU port (verl_tokensel_cpu) failed to load under VERL_PLATFORM=cpu" in res.stderr


def test_cpu_entry_point_registers_the_platform_under_verl_platform_cpu():
    """``import verl`` alone (no ``VERL_USE_EXTERNAL_MODULES``) registers verl's ``cpu`` platform through the
    ``tokensel_cpu`` entry point; off the CPU platform it imports nothing of the port (the stays-light test)."""
    code = (
        "import verl\n"
        "from verl.plugin.platform.platform_manager import PlatformRegistry\n"
        "import verl_tokensel_cpu.plugin as c\n"
        "assert c.LOAD_ERROR is None, c.LOAD_ERROR\n"
        "assert PlatformRegistry.get('cpu').__module__ == 'verl_tokensel_cpu.platform'\n"
    )
    res = _run(code, VERL_PLATFORM="cpu")
    assert res.returncode == 0, res.stderr[-3000:]


def test_selection_product_imports_no_cpu_port():
    """The selection glue, the loss and the driver entry point load without the CPU port."""
    code = BREAK_CPU_PORT + (
        "import verl\n"
        "import verl_tokensel.verl_glue.install, verl_tokensel.verl_glue.workers, verl_tokensel.main_ppo\n"
        "assert not [m for m in sys.modules if m.startswith('verl_tokensel_cpu.')]\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]


def test_import_verl_with_the_plugin_stays_light():
    """``import verl`` runs in every process verl starts; with the plugins it must not import vLLM, verl's trainer
    package, the selection glue or (off the CPU platform) the CPU port beyond its entry point, nor print an
    accelerator warning. The trainer modes still register as soon as verl's trainer package is imported, wherever
    that happens, and the trainer package keeps its own loader."""
    code = (
        "import sys\n"
        "import verl\n"
        "heavy = sorted(m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'verl.trainer.ppo.v1', "
        "'verl.checkpoint_engine', 'verl_tokensel.verl_glue')))\n"
        f"heavy += {PORT_MODULES}\n"
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
        "assert not type(v1.__loader__).__module__.startswith('verl_tokensel'), v1.__loader__\n"
        "assert v1.__spec__.loader is v1.__loader__\n"
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
