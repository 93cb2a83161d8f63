// RUN: hspmd-opt %s -p lower-reshard | filecheck %s

// Physical IR written before device sets were ranges lists them: `hspmd.devices = array<i64: ...>`
// and collectives' `groups = [array<i64: ...>, ...]`. It still reads and verifies; what a pass
// makes anew is printed in the compact forms (`#dist.groups<"...">`), what it keeps as it was.

builtin.module {
  builtin.module @group0 attributes {hspmd.devices = array<i64: 0, 1, 2, 3>} {
    func.func @train_step() {
      %x = graph.input "x" {global_type = tensor<8x4xf32, #dist.layout<"[0-3]: split(0)=2, dup=2">>} : tensor<4x4xf32>
      %a = comm.all_reduce %x {groups = [array<i64: 0, 2>, array<i64: 1, 3>]} : tensor<4x4xf32> -> tensor<4x4xf32>
      %g = dist.reshard %a {src = #dist.layout<"[0-3]: split(0)=2, dup=2">, dst = #dist.layout<"[0-3]: dup=4">} : tensor<4x4xf32> -> tensor<8x4xf32>
      graph.output "g", %g : tensor<8x4xf32>
      func.return
    }
  }
}

// CHECK-LABEL: builtin.module @group0 attributes {hspmd.devices = array<i64: 0, 1, 2, 3>}
// CHECK:         %a = comm.all_reduce %x {groups = [array<i64: 0, 2>, array<i64: 1, 3>]} : tensor<4x4xf32> -> tensor<4x4xf32>
// CHECK-NEXT:    [[G:%.*]] = comm.all_gather %a {groups = #dist.groups<"{0,2},{1,3}">, dim = 0 : i64} : tensor<4x4xf32> -> tensor<8x4xf32>
// CHECK-NEXT:    graph.output "g", [[G]] : tensor<8x4xf32>
