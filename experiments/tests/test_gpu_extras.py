"""The campaign's offline install of its extras (`experiments.gpu.extras`)."""

from experiments.gpu import extras


def test_a_present_module_is_left_alone(tmp_path):
  assert extras.ensure_extras(tmp_path, modules=("PIL",)) == {"PIL": "present"}


def test_a_missing_module_without_a_wheel_says_where_it_looked(tmp_path, monkeypatch):
  monkeypatch.setitem(extras.EXTRAS, "jact_no_such_module", "jact_no_such_module-*.whl")
  status = extras.ensure_extras(tmp_path, modules=("jact_no_such_module",))
  assert status == {"jact_no_such_module": f"no wheel in {tmp_path}"}


def test_a_wheel_pip_refuses_is_reported_not_raised(tmp_path, monkeypatch):
  monkeypatch.setitem(extras.EXTRAS, "jact_no_such_module", "jact_no_such_module-*.whl")
  (tmp_path / "jact_no_such_module-0.1-py3-none-any.whl").write_bytes(b"not a zip file")
  status = extras.ensure_extras(tmp_path, modules=("jact_no_such_module",))
  assert status["jact_no_such_module"].startswith("failed: "), status
