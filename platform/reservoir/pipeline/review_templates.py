"""The review page's HTML (Jinja2, autoescaped: every value from the store is escaped)."""

LAYOUT = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Reservoir review{% if run %}: {{ run }}{% endif %}</title>
<style>
body { font: 15px/1.4 system-ui, sans-serif; margin: 0; background: #f5f6f8; color: #1d2330; }
header { background: #1d2330; color: #fff; padding: 10px 24px; display: flex; gap: 24px; align-items: center; }
header a { color: #cfe0ff; text-decoration: none; } header .who { margin-left: auto; }
main { padding: 16px 24px; max-width: 1100px; }
.turn .role { font-size: 12px; color: #5b6475; } .turn.environment pre { background: #fdf4e3; border-left: 3px solid #d9a441; }
.card { background: #fff; border: 1px solid #d9dde5; border-radius: 8px; padding: 12px 16px; margin-bottom: 14px; }
.meta { color: #5b6475; font-size: 13px; } pre { white-space: pre-wrap; margin: 6px 0; background: #f0f2f6; padding: 8px; border-radius: 6px; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
button { font: inherit; padding: 5px 14px; border-radius: 6px; border: 1px solid #9aa3b5; background: #fff; cursor: pointer; }
button.accept { border-color: #2f8f4e; color: #1f6b38; } button.reject { border-color: #b3363b; color: #8e2428; }
input[type=text], textarea { font: inherit; padding: 4px 6px; border: 1px solid #b8bfcc; border-radius: 5px; }
.done { background: #e5f4ea; border: 1px solid #9fd3b0; padding: 6px 12px; border-radius: 6px; margin-bottom: 12px; }
table { border-collapse: collapse; background: #fff; } td, th { border: 1px solid #d9dde5; padding: 4px 8px; font-size: 13px; text-align: left; }
</style></head><body>
<header><strong>Reservoir review</strong>{% if run %}<span>run {{ run }}</span>{% endif %}
<a href="/">held rows</a><a href="/compare">compare</a><a href="/actions">actions</a>
<span class="who">{% if reviewer %}{{ reviewer }}
<form method="post" action="/logout" style="display:inline"><button>log out</button></form>
{% else %}<a href="/login">log in to review</a>{% endif %}</span></header>
<main>{% if done %}<div class="done">done: {{ done }}</div>{% endif %}{% block body %}{% endblock %}</main>
</body></html>"""

# A response, turn by turn when the environment took part (with_turns), else as its text.
RESPONSE = """{% macro response(row) %}{% if row.turns %}{% for kind, role, text in row.turns %}<div class="turn {{ kind }}"><span class="role">{{ role }}{{ ' · not trained' if kind != 'model' }}</span><pre>{{ text }}</pre></div>
{% endfor %}{% else %}<pre>{{ row.response }}</pre>{% endif %}{% endmacro %}"""

REVIEWS = """{% extends "layout" %}{% from "response" import response %}{% block body %}
<h2>Held rows ({{ rows|length }})</h2>
{% for row in rows %}<div class="card" id="review-{{ row.review_id }}">
<div class="meta">review {{ row.review_id }} · experience {{ row.experience_id }} · run {{ row.run }} · reward {{ row.reward }} · held: {{ row.reason }}</div>
<div><b>prompt</b><pre>{{ row.prompt }}</pre><b>response</b>{{ response(row) }}</div>
{% if reviewer %}<form method="post" action="/reviews/{{ row.review_id }}">
<input type="hidden" name="csrf" value="{{ csrf }}">
<input type="text" name="note" placeholder="note" size="40" value="{{ row.label.note or '' }}">
<input type="text" name="tags" placeholder="tags, comma-separated" size="24" value="{{ (row.label.tags or [])|join(', ') }}">
<button class="accept" name="action" value="accept">accept</button>
<button class="reject" name="action" value="reject">reject</button>
<button name="action" value="label">save label</button></form>
{% endif %}</div>{% else %}<p>No rows are held for review.</p>{% endfor %}
{% endblock %}"""

COMPARE = """{% extends "layout" %}{% from "response" import response %}{% block body %}
<h2>Which response is better?</h2>
{% if pair %}<div class="meta">run {{ pair[0].run }} · task {{ pair[0].task_id }}</div>
<div class="card"><b>prompt</b><pre>{{ pair[0].prompt }}</pre></div>
<div class="pair">{% for row in pair %}{% set other = pair[1 - loop.index0] %}
<div class="card" id="choice-{{ row.experience_id }}"><div class="meta">experience {{ row.experience_id }} · reward {{ row.reward }}</div>
{{ response(row) }}
{% if reviewer %}<form method="post" action="/prefer">
<input type="hidden" name="csrf" value="{{ csrf }}"><input type="hidden" name="after" value="{{ after }}">
<input type="hidden" name="chosen" value="{{ row.experience_id }}"><input type="hidden" name="rejected" value="{{ other.experience_id }}">
<button class="accept">this one is better</button></form>{% endif %}</div>{% endfor %}</div>
<p><a href="/compare?after={{ pair[0].experience_id }}">skip this pair</a></p>
{% else %}<p>No pair of different responses is left to compare.</p>{% endif %}
{% endblock %}"""

ACTIONS = """{% extends "layout" %}{% block body %}
<h2>Latest actions</h2><table><tr><th>when</th><th>who</th><th>action</th><th>from</th>
<th>review</th><th>experience</th><th>preference</th><th>detail</th></tr>
{% for row in rows %}<tr><td>{{ row.created_at.strftime('%Y-%m-%d %H:%M:%S') }}</td><td>{{ row.reviewer }}</td>
<td>{{ row.action }}</td><td>{{ row.source }}</td><td>{{ row.review_id or '' }}</td>
<td>{{ row.experience_id or '' }}</td><td>{{ row.preference_id or '' }}</td><td>{{ row.detail|tojson }}</td></tr>
{% endfor %}</table>{% endblock %}"""

LOGIN = """{% extends "layout" %}{% block body %}
<h2>Log in to review</h2><form method="post" action="/login" class="card">
<p><label>your name <input type="text" name="reviewer" required maxlength="100"></label></p>
<p><label>token <input type="password" name="token" required></label></p>
<button>log in</button></form>{% endblock %}"""

ERROR = """{% extends "layout" %}{% block body %}<div class="card"><b>refused:</b> {{ message }}</div>
<p><a href="/">back</a></p>{% endblock %}"""

TEMPLATES = {"layout": LAYOUT, "response": RESPONSE, "reviews": REVIEWS, "compare": COMPARE,
             "actions": ACTIONS, "login": LOGIN, "error": ERROR}
