fn assert_send<T: Send>(_: T) {}
#[test]
fn send() {
    assert_send(tower_inbox_testdb::TestDatabase::create());
}
#[test]
fn send2() {
    assert_send(tower_inbox_testdb::app_database_url("x"));
}
