"""GenerationMeter from several threads and with wrong types."""

import threading

import pytest

import ddo


def test_two_threads_timing_stages_are_both_recorded():
    meter = ddo.GenerationMeter()
    rounds = 50
    barrier = threading.Barrier(2)
    errors = []

    def work(names):
        try:
            barrier.wait()
            for _ in range(rounds):
                for name in names:
                    with meter.stage(name):
                        pass
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(["shared", "a"],)),
               threading.Thread(target=work, args=(["shared", "b"],))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    calls = {s["name"]: s["calls"] for s in meter.finish()["stages"]}
    assert calls == {"shared": 2 * rounds, "a": rounds, "b": rounds}


def test_two_threads_inside_one_stage_at_once_are_two_calls():
    meter = ddo.GenerationMeter()
    both_inside = threading.Barrier(2, timeout=30)

    def work():
        with meter.stage("shared"):
            both_inside.wait()  # each thread's span is open while the other's is

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (stage,) = meter.finish()["stages"]
    assert stage["name"] == "shared" and stage["calls"] == 2


def test_a_stage_is_ended_only_by_the_thread_that_began_it():
    meter = ddo.GenerationMeter()
    meter.begin_stage("vae")
    failed = []

    def other():
        try:
            meter.end_stage("vae")
        except RuntimeError as e:
            failed.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert failed and "open on this thread" in failed[0]
    meter.end_stage("vae")
    assert [(s["name"], s["calls"]) for s in meter.finish()["stages"]] == [("vae", 1)]


@pytest.mark.parametrize("call, words", [
    (lambda: ddo.GenerationMeter({"transformer": object()}),
     "component 'transformer' is a object, expected what ddo.enable_offload returns"),
    (lambda: ddo.GenerationMeter(["transformer"]), "takes a mapping"),
    (lambda: ddo.GenerationMeter(cuda_device=0), "cuda_device=...) takes a str"),
    (lambda: ddo.GenerationMeter().add("te", "not an offload"), "component 'te' is a str"),
    (lambda: ddo.GenerationMeter().begin_stage(3), "begin_stage(name=...) takes a str, not int"),
    (lambda: ddo.GenerationMeter().end_stage(None), "end_stage(name=...) takes a str"),
    (lambda: ddo.GenerationMeter().drop(b"x"), "drop(name=...) takes a str, not bytes"),
])
def test_wrong_types_are_type_errors_naming_the_argument(call, words):
    with pytest.raises(TypeError) as e:
        call()
    assert words in str(e.value)


def test_stage_with_a_wrong_name_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"stage\(name=...\) takes a str, not int"):
        with ddo.GenerationMeter().stage(1):
            pass
