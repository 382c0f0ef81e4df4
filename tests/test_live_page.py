"""
The live belt (issue 41, section 1): the page at GET / of tools/serve.py, which is tools/explore.html fed live,
in headless Chromium, against a live --quick server on a free port of 127.0.0.1, as students would use it. The
story, on two slots, each request named by its letter on the belt:
  step 0     A, sent by a client that is no page (curl, say), takes slot 0, and the engine is held after the
             step while two pages send a prompt each: B from one, then C from the other
  step 1     B takes slot 1 and makes its first token, A its second and last; C waits for a slot. The engine
             is held again, and the pages looked at: B outlined in its slot on its page, C's letter outlined
             in the queue on its own
  step 2     C takes A's slot, and B and C ride the belt side by side
  steps 4-6  C's third and last token at step 4, B's sixth at step 6
Each page must show its own request, and only its own, outlined on the belt (its letter and colour the
engine's, belt_svg.py's), its state as it went (sent, waiting, admitted, making tokens, finished), and its
answer as it grows: the very tokens the engine made for it (offline, as token ids; the prompt went as its
UTF-8 bytes). Then a teacher steps back with the arrow keys (the page pauses) and follows live again.
One server and one browser for the file; the engine held between steps by its on_step (Steps, below), never
by a sleep. Chromium is driven over the DevTools protocol on a pipe, a timeout on every read: a failure ends
the test, never hangs the suite, and the browser, the server and the engine's hold end in `finally`.
"""
import fcntl
import http.client
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

import nanobatch
from tests.common import TIMEOUT_S
import belt_svg  # noqa: E402 (tools/, put on the path by tests.common)
import explore  # noqa: E402
import serve  # noqa: E402

WAIT_S = 10  # a page, the engine or the browser that takes longer than this has hung
PROMPTS = {"B": ("The capital of France is", 6), "C": ("Ça va ?", 3)}  # each page's (prompt, max_tokens)
A_PROMPT, A_TOKENS = [7, 8, 9], 2  # the client's


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe): JSON messages,
    each ended by a NUL byte, sent on its fd 3 and answered on its fd 4. A page is a target with a session."""

    def __init__(self, path):
        commands_in, self.commands = os.pipe()
        self.replies, replies_out = os.pipe()
        # Chromium's ends above fd 4, so that putting one at fd 3 cannot close the other (pytest leaves 3 and 4 free)
        low_ends = (commands_in, replies_out)
        commands_in, replies_out = (fcntl.fcntl(fd, fcntl.F_DUPFD, 5) for fd in low_ends)
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={self.profile}",
                 "--remote-debugging-pipe", "--window-size=1400,1000",
                 # every page as if in front: a page behind another has its timers slowed to one a second
                 "--disable-background-timer-throttling", "--disable-renderer-backgrounding", "about:blank"]
        # bash puts the two pipes where Chromium looks for them, fds 3 and 4, and becomes Chromium.
        exec_chromium = f'exec "$0" "$@" 3<&{commands_in} 4>&{replies_out}'
        self.process = subprocess.Popen(["bash", "-c", exec_chromium, path, *flags], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, pass_fds=(commands_in, replies_out))
        for fd in (commands_in, replies_out, *low_ends):
            os.close(fd)
        self.n_sent, self.unread, self.events = 0, b"", []

    def read(self, deadline):
        """The next message from Chromium, or a TimeoutError at deadline (time.monotonic())."""
        while b"\0" not in self.unread:
            ready, _, _ = select.select([self.replies], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            data = os.read(self.replies, 1 << 20)
            if not data:
                raise EOFError("Chromium has gone")
            self.unread += data
        message, self.unread = self.unread.split(b"\0", 1)
        message = json.loads(message)
        if "method" in message:  # an event: kept for wait_for and for the page's errors
            self.events.append(message)
        return message

    def send(self, method, session=None, timeout=WAIT_S, **params):
        """A command -> its result; a command Chromium refuses raises."""
        self.n_sent += 1
        message = dict(id=self.n_sent, method=method, params=params, **({"sessionId": session} if session else {}))
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while (reply := self.read(deadline)).get("id") != self.n_sent:
            pass
        assert "error" not in reply, f"{method}: {reply['error']}"
        return reply["result"]

    def open(self, url, n_pages):
        """n_pages new pages at url, loading together -> their sessions, once each has loaded."""
        sessions = []
        for _ in range(n_pages):
            target = self.send("Target.createTarget", url="about:blank")["targetId"]
            sessions.append(self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"])
            self.send("Runtime.enable", sessions[-1])
            self.send("Page.enable", sessions[-1])
            self.send("Page.navigate", sessions[-1], url=url)
        deadline = time.monotonic() + WAIT_S
        while not all(any(event["method"] == "Page.loadEventFired" and event.get("sessionId") == session
                          for event in self.events) for session in sessions):
            self.read(deadline)
        return sessions

    def run(self, session, script, timeout=WAIT_S):
        """A JavaScript expression in the page, awaited -> its value (as JSON takes it)."""
        result = self.send("Runtime.evaluate", session, timeout=timeout, expression=script, awaitPromise=True,
                           returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]["exception"]["description"]
        return result["result"].get("value")

    def until(self, session, condition, shown="null"):
        """Wait until the JavaScript expression condition is truthy in the page -> its value. Past WAIT_S, an
        error that says what the expression shown gave then."""
        return self.run(session, f"""new Promise((resolve, reject) => {{
          const start = performance.now();
          (function poll() {{
            const value = {condition};
            if (value) resolve(value);
            else if (performance.now() - start > {1000 * WAIT_S}) {{
              reject(new Error("waited in vain; the page shows " + JSON.stringify({shown})));
            }} else setTimeout(poll, 10);
          }})();
        }})""", timeout=WAIT_S + 5)  # the page's own timeout first, which says what it waited for

    KEY_CODES = {"ArrowLeft": 37, "ArrowRight": 39, "End": 35, "Home": 36}  # Windows' virtual key codes, as CDP takes

    def press(self, session, key):
        """A real key press in the page, as the keyboard makes it (Chromium's input pipeline, not a script's event):
        an arrow, End, Home, or a character (which types itself into the focused field)."""
        code = self.KEY_CODES.get(key)
        down = dict(key=key, windowsVirtualKeyCode=code, code=key) if code else dict(key=key, text=key)
        self.send("Input.dispatchKeyEvent", session, type="keyDown" if code else "keyDown", **down)
        self.send("Input.dispatchKeyEvent", session, type="keyUp", key=key, **({"windowsVirtualKeyCode": code}
                                                                                 if code else {}))

    def click(self, session, selector, at=0.5):
        """A real mouse click (pressed, released) on the element, at the fraction `at` of its width."""
        box = self.run(session, f"""(() => {{ const box = document.querySelector({json.dumps(selector)})
          .getBoundingClientRect(); return [box.left + {at} * box.width, box.top + box.height / 2]; }})()""")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", session, type=kind, x=box[0], y=box[1], button="left",
                      clickCount=1)

    def n_loads(self, session):  # the loads of the page so far
        return sum(event["method"] == "Page.loadEventFired" and event.get("sessionId") == session
                   for event in self.events)

    def errors(self):
        """What the pages threw, uncaught, and what they said as errors or warnings (the page's way with an error
        it recovers from: /steps read again)."""
        return [event["params"] for event in self.events if event["method"] == "Runtime.exceptionThrown" or
                event["method"] == "Runtime.consoleAPICalled" and event["params"]["type"] in ("error", "warning")]

    def close(self):
        self.process.terminate()  # Browser.close would wait on the pages' connections to the server
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        os.close(self.commands)
        os.close(self.replies)
        shutil.rmtree(self.profile, ignore_errors=True)


class Steps:
    """The engine held between steps: serve's on_step, once its step's event is out, waits until the test
    lets the engine on (run_to), or runs free. It notes each finished request's tokens, the engine's own."""

    def __init__(self):
        self.changed = threading.Condition()
        self.n_ended, self.allowed = 0, 0  # steps ended; how many may end before the engine waits (None: all)
        self.tokens = {}  # request index -> the tokens the engine made for it, as its report finished it

    def on_step(self, engine, report):  # serve.Engine.on_step, then the hold, on the engine's thread
        ON_STEP(engine, report)
        with self.changed:
            self.tokens.update((i, completion.tokens) for i, completion in report.finished)
            self.n_ended += 1
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.allowed is None or self.n_ended < self.allowed, timeout=WAIT_S)

    def run_to(self, n_steps):
        """Let the engine run until n_steps have ended in all (it holds after each step until told), then hold it."""
        with self.changed:
            self.allowed = n_steps
            self.changed.notify_all()
            assert self.changed.wait_for(lambda: self.n_ended >= n_steps, timeout=WAIT_S), \
                f"the engine ended {self.n_ended} steps, not {n_steps}"

    def run_free(self):
        with self.changed:
            self.allowed = None
            self.changed.notify_all()


ON_STEP = serve.Engine.on_step  # the real one, before the fixture wraps it

# What the page shows, read from the DOM: its requests' cards, the belt's stays, the queue, the step shown.
LOOK = """(() => {
  const cards = [...document.querySelectorAll("#cards .card")].map((card) => ({...card.dataset,
    colour: card.style.getPropertyValue("--c"), answer: card.querySelector(".answer").textContent}));
  const stays = [...document.querySelectorAll("#live-belt rect.stay")].map((rect) => ({
    request: +rect.dataset.request, slot: +rect.dataset.slot, first: +rect.dataset.first, last: +rect.dataset.last,
    mine: rect.dataset.mine === "1", colour: rect.getAttribute("fill"),
    letter: rect.parentNode.querySelector("text")?.textContent}));
  const queue = [...document.querySelectorAll("#queue .chip")].map((chip) =>
    [+chip.dataset.request, chip.classList.contains("mine")]);
  return {cards, stays, queue, shown: +document.querySelector("#shown-step").textContent,
          newest: +document.querySelector("#live-belt").dataset.lastStep,  // the belt's newest step drawn
          frame: +document.querySelector("#live-belt .live-mark")?.dataset.step,
          following: document.querySelector("#following").dataset.following};
})()"""


def look_once(condition):
    """A JavaScript expression: what the page shows (LOOK), once condition holds of it (look); else false."""
    return f"(() => {{ const look = {LOOK}; return ({condition}) && look; }})()"


def send_from(browser, page, prompt, max_tokens):
    """Type a prompt into the page and press send (greedy, so that the engine's tokens are known)."""
    browser.run(page, f"""document.querySelector("#prompt").value = {json.dumps(prompt)};
      document.querySelector("#max-tokens").value = {max_tokens};
      document.querySelector("#temperature").value = 0;
      document.querySelector("#send-button").click();""")


def get_page(port):
    """GET / -> the page, as text."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        connection.request("GET", "/")
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def stream_from_a_client(port, prompt, max_tokens, out):
    """A client that is no page: a streamed completion over http.client, its chunks into out."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json"})
        out.append(connection.getresponse().read().decode())
    finally:
        connection.close()


@pytest.fixture(scope="module")
def session():
    """The story above, run once -> {what each page showed at step 1 and at the end, the engine's tokens and
    the prompts it received by request index, the client's stream, and the browser and its pages, still open}."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no Chromium here to open the page in (Debian: apt-get install chromium)")
    steps, sent = Steps(), {}
    submit = serve.Engine.submit

    def recording_submit(engine, request, *args):  # the prompts as the engine received them
        stream = submit(engine, request, *args)
        sent[stream.request_index] = request.prompt
        return stream

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(serve.Engine, "on_step", lambda engine, report: steps.on_step(engine, report))
        monkeypatch.setattr(serve.Engine, "submit", recording_submit)
        browser, engine, client = Chromium(chromium), None, None  # Chromium starts while the server loads
        try:
            engine = serve.start(serve.parse(["--quick", "--port", "0", "--slots", "2"]))
            port = engine.address[1]
            page_text = get_page(port)
            pages = dict(zip(PROMPTS, browser.open(f"http://127.0.0.1:{port}/", len(PROMPTS))))
            idle = {name: browser.until(page, 'document.querySelector("#following").dataset.connected === "1" && '
                                              'document.querySelector("#following").textContent')
                    for name, page in pages.items()}  # each page reads /steps before anything is sent
            client_out = []
            client = threading.Thread(target=stream_from_a_client, args=(port, A_PROMPT, A_TOKENS, client_out),
                                      daemon=True)
            client.start()
            steps.run_to(1)  # step 0, then held: A in slot 0
            for name, (prompt, max_tokens) in PROMPTS.items():  # B, then C, each waiting: the engine is held
                send_from(browser, pages[name], prompt, max_tokens)
                browser.until(pages[name], 'document.querySelector("#cards .card").dataset.id')
            steps.run_to(2)  # step 1: B in slot 1 with its first token (on its page, once it streamed), C waits
            at_step_1 = {name: browser.until(page, look_once("look.newest === 1 && (look.cards[0].status === "
                                                             "'waiting' || look.cards[0].answer)"), LOOK)
                         for name, page in pages.items()}
            steps.run_free()
            at_end = {name: browser.until(page, look_once("look.newest === 6 && look.cards[0].status === 'finished'"),
                                          LOOK) for name, page in pages.items()}
            client.join(WAIT_S)
            yield dict(browser=browser, pages=pages, at_step_1=at_step_1, at_end=at_end, tokens=steps.tokens,
                       sent=sent, client=client_out, page=page_text, idle=idle, port=port)
        finally:
            steps.run_free()
            browser.close()
            if engine is not None:
                serve.stop(engine)
            if client is not None:
                client.join(WAIT_S)


def test_the_page_is_explore_html_fed_live(session):
    """GET / is tools/explore.html with its three markers filled in, no copy of its script or its style: in its
    belts' place tools/serve.html, the live part; as its data a run named live with no step yet (the steps come
    from /steps), and what the server serves, belt_svg.py's sizes among it."""
    data = json.loads(re.search(r'<script type="application/json" id="nanobatch-run">(.*?)</script>', session["page"],
                                re.S)[1])
    assert session["page"] == explore.filled(data, serve.PAGE.read_text()), "GET / is not explore.html filled in"
    assert [(run["name"], run["n_slots"], run["steps"]) for run in data["runs"]] == [("live", 2, [])]
    assert data["live"]["has_tokenizer"] is False
    assert data["live"]["belt"]["left"] == belt_svg.LEFT and data["live"]["belt"]["width"] == belt_svg.SVG_WIDTH


def request_of(look):
    """The request index a page's card names (its id's, as the steps named it)."""
    (card,) = look["cards"]
    return int(card["request"])


def test_a_prompt_sent_from_the_page_shows_its_letter_on_the_belt_and_its_answer(session):
    """B, sent from its page: its card names it by its letter and colour (the engine's, belt_svg.py's); it rode
    the belt outlined in slot 1 from step 1 to step 6; its state went sent, admitted, making tokens,
    finished; its answer grew from its first token to the tokens the engine made for it; and its prompt
    went as its UTF-8 bytes."""
    look = session["at_end"]["B"]
    b = request_of(look)
    (card,) = look["cards"]
    prompt, max_tokens = PROMPTS["B"]
    assert session["sent"][b] == list(prompt.encode()), "the prompt did not go as its UTF-8 bytes"
    assert (card["letter"], card["colour"]) == (nanobatch.letter(b), belt_svg.colour(b)) == ("B", belt_svg.colour(1))
    tokens = session["tokens"][b]
    assert session["at_step_1"]["B"]["cards"][0]["answer"] == str(tokens[0]), "its first token, at step 1"
    assert card["answer"] == " ".join(map(str, tokens)) and len(tokens) == max_tokens, "its answer"
    assert card["seen"] == "sent admitted decoding finished", card["seen"]
    mine = [stay for stay in look["stays"] if stay["mine"]]
    assert [(s["request"], s["slot"], s["first"], s["last"], s["letter"], s["colour"]) for s in mine] == \
        [(b, 1, 1, 6, "B", belt_svg.colour(b))], mine
    assert not session["browser"].errors(), session["browser"].errors()


def test_two_senders_each_see_their_own_request(session):
    """At step 1, B's page outlines B in slot 1, making tokens; C's page outlines its own letter in the
    queue, waiting; neither outlines the other's, nor A (sent by a client that is no page). At the end every
    request is drawn on both pages, each outlines its own only, each card holds its own answer, and C went
    sent, waiting, admitted, making tokens, finished, in A's slot from step 2."""
    b, c = (request_of(session["at_end"][name]) for name in "BC")
    a = next(i for i in session["tokens"] if i not in (b, c))
    assert session["at_end"]["B"]["cards"][0]["id"] != session["at_end"]["C"]["cards"][0]["id"]
    on_b, on_c = session["at_step_1"]["B"], session["at_step_1"]["C"]
    assert sorted((s["request"], s["slot"], s["mine"]) for s in on_b["stays"]) == [(a, 0, False), (b, 1, True)]
    assert on_b["queue"] == [[c, False]] and on_b["cards"][0]["status"] == "decoding", on_b
    assert on_c["queue"] == [[c, True]] and on_c["cards"][0]["status"] == "waiting", on_c
    assert not any(stay["mine"] for stay in on_c["stays"]), "C's page outlines a request that is not C's"
    for name, me in (("B", b), ("C", c)):
        look = session["at_end"][name]
        assert {stay["request"] for stay in look["stays"]} == {a, b, c}, f"{name}'s page: not every request drawn"
        assert {stay["request"] for stay in look["stays"] if stay["mine"]} == {me}, f"{name}'s page outlines another's"
        assert look["cards"][0]["answer"] == " ".join(map(str, session["tokens"][me])), f"{name}'s answer"
    assert session["at_end"]["C"]["cards"][0]["seen"] == "sent waiting admitted decoding finished"
    c_stay = next(s for s in session["at_end"]["C"]["stays"] if s["request"] == c)
    assert (c_stay["slot"], c_stay["first"], c_stay["last"]) == (0, 2, 4), "C not in A's slot from step 2"
    assert session["client"] and session["client"][0].endswith("data: [DONE]\n\n"), "A's stream did not end"


def test_a_teacher_steps_back_and_follows_again(session):
    """With the belt still, the left arrow shows the step before (three presses: step 3) and pauses; the
    frame on the belt moves with it; End follows live again, at the newest step."""
    browser, page = session["browser"], session["pages"]["B"]
    press = 'window.dispatchEvent(new KeyboardEvent("keydown", {key: "%s"}));'
    browser.run(page, " ".join([press % "ArrowLeft"] * 3))
    look = browser.run(page, LOOK)
    assert (look["shown"], look["frame"], look["following"]) == (3, 3, "0"), look
    browser.run(page, press % "End")
    look = browser.run(page, LOOK)
    assert (look["shown"], look["frame"], look["following"]) == (6, 6, "1"), look
    assert not browser.errors(), browser.errors()


def test_idle_the_page_says_it_is_connected_and_waits(session):
    """Before any step, connected to /steps, each page says so: connected, waiting for the first step."""
    assert set(session["idle"].values()) == {"live: connected, waiting for the first step"}, session["idle"]


def test_typing_and_sending_never_pause_it(session):
    """On B's page, following live: real clicks into the prompt box and on send, real keys typed there (an arrow
    among them, which moves the cursor, not the step): the page still follows, and shows the newest step once the
    request it sent has finished."""
    browser, page = session["browser"], session["pages"]["B"]
    browser.click(page, "#prompt")
    for key in [" ", "x", "ArrowLeft", "y"]:
        browser.press(page, key)
    assert browser.run(page, 'document.querySelector("#prompt").value').endswith(" yx")
    browser.click(page, "#send-button")
    look = browser.until(page, look_once("look.cards.length === 2 && look.cards[0].status === 'finished' && "
                                         "!live.isDrawPending && look.newest === DATA.runs[0].steps.at(-1).step"), LOOK)
    assert look["newest"] > 6, "no step came after the send"
    assert (look["following"], look["shown"], look["frame"]) == ("1", look["newest"], look["newest"]), look
    assert browser.run(page, 'document.querySelector("#following").textContent') == f"live: step {look['newest']}"


def test_back_pauses_and_the_label_counts_the_newest(session):
    """On C's page: a real ← steps back a step and pauses; steps that come meanwhile (a client's request) leave the
    step shown where it is, while the label and the slider count every step received; End follows live again; a
    real click at the slider's left end goes to the first step kept, and pauses."""
    browser, page = session["browser"], session["pages"]["C"]
    before = browser.until(page, look_once("look.following === '1'"), LOOK)
    browser.press(page, "ArrowLeft")
    look = browser.run(page, LOOK)
    assert (look["following"], look["shown"]) == ("0", before["newest"] - 1), look
    out = []
    stream_from_a_client(session["port"], [5, 6], 4, out)  # four more steps, at least
    look = browser.until(page, look_once(f"look.newest >= {before['newest'] + 4}"), LOOK)
    n_steps = browser.run(page, "DATA.runs[0].steps.length")
    assert (look["following"], look["shown"]) == ("0", before["newest"] - 1), "the page moved while paused"
    label = browser.run(page, 'document.querySelector("#step-count").textContent')
    assert f"of {n_steps} steps" in label and browser.run(page, "+document.querySelector('#slider').max") == \
        n_steps - 1, label
    assert "paused (the newest: step" in browser.run(page, 'document.querySelector("#following").textContent')
    browser.press(page, "End")
    look = browser.run(page, LOOK)
    assert (look["following"], look["shown"]) == ("1", look["newest"]), look
    browser.click(page, "#slider", at=0.0)
    look = browser.run(page, LOOK)
    assert (look["following"], look["shown"]) == ("0", 0), look
    browser.press(page, "End")
    assert not browser.errors(), browser.errors()


def test_with_an_api_key_the_page_asks_for_it_once(session, tmp_path):
    """A server with --api-key: its page asks for the key; typed (real keys) and sent (a real click), the live page
    opens, connected to /steps, and a prompt sent from it is answered, the browser's cookie standing for the key; a
    second page of the same browser asks nothing. The screenshot of the page, for a person to look at, is taken."""
    browser = session["browser"]
    engine = serve.start(serve.parse(["--quick", "--port", "0", "--slots", "2", "--api-key", "sesame"]))
    try:
        url = f"http://127.0.0.1:{engine.address[1]}/"
        [page] = browser.open(url, 1)
        assert browser.run(page, "!!document.querySelector('#key') && typeof DATA === 'undefined'"), "no key asked"
        browser.click(page, "#key")
        for key in "wrong":
            browser.press(page, key)
        browser.click(page, "button")
        assert browser.until(page, "document.querySelector('#said').textContent") == "wrong key"
        browser.run(page, "document.querySelector('#key').value = ''")
        browser.click(page, "#key")
        for key in "sesame":
            browser.press(page, key)
        n_loads, deadline = browser.n_loads(page), time.monotonic() + WAIT_S
        browser.click(page, "button")
        while browser.n_loads(page) == n_loads:  # the page reloads, the cookie its key
            browser.read(deadline)
        browser.until(page, 'document.querySelector("#following")?.dataset.connected === "1"')
        browser.click(page, "#send-button")
        browser.until(page, look_once("look.cards.length === 1 && look.cards[0].status === 'finished'"), LOOK)
        [second] = browser.open(url, 1)
        browser.until(second, 'document.querySelector("#following")?.dataset.connected === "1"')
        shot = browser.send("Page.captureScreenshot", page)["data"]
        (tmp_path / "live.png").write_bytes(__import__("base64").b64decode(shot))
        assert not browser.errors(), browser.errors()
    finally:
        serve.stop(engine)
