"""``POST /v1/audio/speech`` refuses what only a client bug sends, as a 400 naming the field: a wrong type (a bool
as a seed, a string as a number or a switch), an oversized ``model`` or ``instructions``, a ``prompt`` that is not
ChatTTS prompt tags, sampling values past what the sampler takes. Right values of the right type still speak."""

from __future__ import annotations

import pytest

from chattts_velocity.sampling.limits import MIN_TEMPERATURE
from chattts_velocity.server import ServerConfig

fastapi_testclient = pytest.importorskip("fastapi.testclient", reason="the server needs the server extra")

from chattts_velocity.server.schema import MAX_INSTRUCTIONS_CHARS, MAX_MODEL_CHARS, SpeechRequest  # noqa: E402

SPEECH = "/v1/audio/speech"
BODY = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm", "seed": 3}


@pytest.fixture(scope="module")
def client(chat):
    from chattts_velocity.server.app import build_app
    from chattts_velocity.serving.local import LocalClient

    with fastapi_testclient.TestClient(build_app(LocalClient(chat), ServerConfig(max_new_token=16))) as c:
        yield c


REFUSED = [
    ({"seed": True}, "seed"),
    ({"seed": "3"}, "seed"),
    ({"seed": 3.0}, "seed"),
    ({"speed": "1"}, "speed"),
    ({"speed": True}, "speed"),
    ({"temperature": "0.3"}, "temperature"),
    ({"top_p": "0.7"}, "top_p"),
    ({"top_k": "20"}, "top_k"),
    ({"refine_text": "yes"}, "refine_text"),
    ({"refine_text": 1}, "refine_text"),
    ({"model": "m" * (MAX_MODEL_CHARS + 1)}, "model"),
    ({"instructions": "i" * (MAX_INSTRUCTIONS_CHARS + 1)}, "instructions"),
    ({"prompt": "[spk_emb]"}, "prompt"),
    ({"prompt": "[Stts]"}, "prompt"),
    ({"prompt": "[Ptts]"}, "prompt"),
    ({"prompt": "[speed_5][empty_spk]"}, "prompt"),
    ({"prompt": "[speed_10]"}, "prompt"),
    ({"prompt": "[laugh_3]"}, "prompt"),
    ({"prompt": "speak slowly"}, "prompt"),
    ({"temperature": 1e-300}, "temperature"),
    ({"temperature": MIN_TEMPERATURE / 2}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
]


@pytest.mark.parametrize("change, param", REFUSED, ids=[f"{next(iter(c))}={next(iter(c.values()))!r:.24}"
                                                         for c, _ in REFUSED])
def test_a_client_bug_is_a_400_naming_the_field(client, change, param):
    r = client.post(SPEECH, json={**BODY, **change})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"{param}:"), err["message"]


ACCEPTED = [
    {"speed": 1},
    {"speed": 1.5},
    {"temperature": 1},
    {"temperature": MIN_TEMPERATURE},
    {"top_p": 1},
    {"top_k": 1},
    {"seed": None},
    {"refine_text": False},
    {"prompt": "[speed_3]"},
    {"prompt": "[speed_0][oral_9][laugh_2][break_7]"},
    {"prompt": ""},
    {"model": "m" * MAX_MODEL_CHARS},
    {"instructions": "i" * MAX_INSTRUCTIONS_CHARS},
]


@pytest.mark.parametrize("change", ACCEPTED, ids=[f"{next(iter(c))}={next(iter(c.values()))!r:.24}"
                                                  for c in ACCEPTED])
def test_right_values_of_the_right_type_still_speak(client, change):
    r = client.post(SPEECH, json={**BODY, **change})
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) > 0


def test_an_int_speed_is_the_same_request_as_its_float():
    assert SpeechRequest(**{**BODY, "speed": 2}) == SpeechRequest(**{**BODY, "speed": 2.0})
    assert SpeechRequest(**{**BODY, "prompt": "[speed_3]"}).speed_prompt() == "[speed_3]"
